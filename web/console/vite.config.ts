import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

// Served by the gateway at /console from web/console/dist, under a CSP that allows no inline
// script or style: the build emits only files (no inline module-preload polyfill).
export default defineConfig({
  base: "/console/",
  plugins: [react()],
  build: {
    outDir: "dist",
    emptyOutDir: true,
    modulePreload: { polyfill: false },
    sourcemap: false,
  },
  server: {
    // `vite` in web/console against a running stack: the API on the gateway's HTTP port.
    proxy: { "/v2": process.env.TETHER_HTTP ?? "http://127.0.0.1:8080" },
  },
});
