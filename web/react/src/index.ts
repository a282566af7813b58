export * from "./hooks.js";
export * from "./cards.js";
