import react from "@vitejs/plugin-react";
import { defineConfig } from "vitest/config";

// The browser side's unit tests (web/*/test); `make test` runs them before pytest.
export default defineConfig({
  plugins: [react()],
  test: {
    include: ["web/*/test/**/*.test.{ts,tsx}"],
    environment: "node",
    testTimeout: 10000,
  },
});
