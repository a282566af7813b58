import { describe, expect, it } from "vitest";
import { addRequest, nextFire, parseDuration, policies } from "../src/schedules.js";

const FORM = { agent: " reporter ", cron: " 0 9 * * 1-5 ", timezone: "Europe/Paris", message: "report", overlap: "skip", catchUp: "latest", window: "" };

describe("addRequest", () => {
  it("trims the agent and cron and leaves the default window out", () => {
    expect(addRequest(FORM)).toEqual({
      agent: "reporter", cron: "0 9 * * 1-5", timezone: "Europe/Paris", message: "report", overlap: "skip", catchUp: "latest",
    });
  });

  it("sends a catch-up window in seconds, and refuses one that is not a duration", () => {
    expect(addRequest({ ...FORM, catchUp: "all", window: "6h" }).catchUpWindowSeconds).toBe("21600");
    expect(() => addRequest({ ...FORM, catchUp: "all", window: "six hours" })).toThrow(/not a duration/);
    expect(parseDuration("90")).toBe(90);
    expect(parseDuration("2d")).toBe(172800);
    expect(parseDuration("1w")).toBeNull();
  });
});

describe("nextFire and policies", () => {
  it("shows the next fire time in the schedule's timezone and in UTC, and paused while paused", () => {
    const schedule = { nextFireAt: "2026-03-02T08:00:00Z", timezone: "Europe/Paris", paused: false };
    expect(nextFire(schedule)).toBe("Mon 2 Mar, 09:00 Europe/Paris (2026-03-02 08:00 UTC)");
    expect(nextFire({ ...schedule, paused: true })).toBe("paused");
  });

  it("names the policies as the CLI does", () => {
    expect(policies({ overlap: "skip", catchUp: "latest" })).toBe("overlap skip, catch-up latest");
    expect(policies({ overlap: "allow", catchUp: "all", catchUpWindowSeconds: "21600" })).toBe("overlap allow, catch-up all within 6 h");
  });
});
