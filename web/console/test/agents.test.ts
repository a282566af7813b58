import { describe, expect, it } from "vitest";
import { TetherError } from "@tether/client";
import { applyRefusal, routesOf } from "../src/agents.js";

describe("routesOf", () => {
  it("names each route's source and channel, and a route with neither as any run", () => {
    const doc = JSON.stringify({ routes: [{ source: "api", channel: "whatsapp" }, { channel: "web" }, {}] });
    expect(routesOf(doc)).toEqual(["source api, channel whatsapp", "channel web", "any run"]);
  });

  it("is empty for a document without routes or none loaded", () => {
    expect(routesOf('{"name":"helper"}')).toEqual([]);
    expect(routesOf(undefined)).toEqual([]);
  });
});

describe("applyRefusal", () => {
  it("names the stale base version of a 409 and keeps the server's words", () => {
    const stale = new TetherError(409, "ABORTED", "aborted", "agent helper is at version 3, not 2");
    const said = applyRefusal(stale, 2);
    expect(said.title).toBe("Conflict: version 2 is no longer the published version; nothing was applied.");
    expect(said.detail).toContain("agent helper is at version 3, not 2");
  });

  it("says a rollback on a stale base rolled nothing back", () => {
    const stale = new TetherError(409, "ABORTED", "aborted", "agent helper is at version 3, not 2");
    const said = applyRefusal(stale, 2, "rolled back");
    expect(said.title).toBe("Conflict: version 2 is no longer the published version; nothing was rolled back.");
    expect(said.detail).toContain("agent helper is at version 3, not 2");
  });

  it("lists an invalid document's violations as the server gave them", () => {
    const bad = new TetherError(400, "INVALID_ARGUMENT", "invalid_argument", "/limits/max_steps: must be >= 1");
    expect(applyRefusal(bad, 1)).toEqual({
      title: "The document was refused; nothing was applied.",
      detail: "/limits/max_steps: must be >= 1",
    });
  });
});
