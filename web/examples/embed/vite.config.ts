import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

// An example of another app embedding the cards: served from its own origin, it calls the
// gateway cross-origin (CORS) with short-lived tokens its backend mints (POST /token here).
export default defineConfig({
  plugins: [react()],
  build: { outDir: "dist", emptyOutDir: true, modulePreload: { polyfill: false } },
});
