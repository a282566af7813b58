export * from "./client.js";
export * from "./errors.js";
export * from "./sse.js";
export * from "./streams.js";
export * from "./state.js";
export type * from "./gen/tether/v1/common_pb.js";
export type * from "./gen/tether/v1/events_pb.js";
export type * from "./gen/tether/v1/gateway_pb.js";
export type * from "./gen/tether/v1/interactions_pb.js";
