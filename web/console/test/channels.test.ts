import { describe, expect, it } from "vitest";
import { addRequest, parseGrace, previousSecret, secretHints } from "../src/channels.js";

describe("addRequest", () => {
  it("puts a Slack form's secrets in secrets and leaves an empty API base URL out", () => {
    const body = addRequest("slack", " demo ", "", { signingSecret: " s3cret ", botToken: "xoxb-1", apiBaseUrl: "  " });
    expect(body).toEqual({ kind: "slack", name: "demo", secrets: { signingSecret: " s3cret ", botToken: "xoxb-1" } });
  });

  it("puts WhatsApp's phone number id in settings and keeps the agent and API base URL", () => {
    const body = addRequest("whatsapp", "wa", "support", {
      appSecret: "a", verifyToken: "v", accessToken: "t", phoneNumberId: "123", apiBaseUrl: "http://127.0.0.1:9/",
    });
    expect(body).toEqual({
      kind: "whatsapp", name: "wa", agent: "support", apiBaseUrl: "http://127.0.0.1:9/",
      secrets: { appSecret: "a", verifyToken: "v", accessToken: "t" }, settings: { phoneNumberId: "123" },
    });
  });

  it("maps a generic webhook's pointers and reply URL", () => {
    const body = addRequest("webhook", "hook", "", {
      secret: "whsec_x", textField: "/text", threadField: "/t", senderField: "/s", eventIdField: "/id", replyUrl: "https://example.com/r",
    });
    expect(body.settings).toEqual({ textField: "/text", threadField: "/t", senderField: "/s", eventIdField: "/id" });
    expect(body.replyUrl).toBe("https://example.com/r");
    expect(body.secrets).toEqual({ secret: "whsec_x" });
  });
});

describe("secretHints and previousSecret", () => {
  it("shows each secret as its name and last four", () => {
    expect(secretHints({ secrets: [{ name: "signing_secret", lastFour: "cret" }, { name: "bot_token", lastFour: "" }] })).toEqual([
      "signing_secret …cret",
      "bot_token",
    ]);
  });

  it("says until when a replaced secret verifies, and none once its grace ended", () => {
    const now = Date.parse("2026-12-04T12:00:00Z");
    expect(previousSecret({}, now)).toBe("none");
    expect(previousSecret({ previousSecretExpiresAt: "2026-12-05T12:00:00Z" }, now)).toBe("verifies until 2026-12-05T12:00:00Z");
    expect(previousSecret({ previousSecretExpiresAt: "2026-12-04T11:00:00Z" }, now)).toBe("none (its grace has ended)");
  });
});

describe("parseGrace", () => {
  it("reads the CLI's durations and refuses anything else", () => {
    expect(parseGrace("24h")).toBe(86400);
    expect(parseGrace(" 30m ")).toBe(1800);
    expect(parseGrace("0s")).toBe(0);
    expect(parseGrace("7d")).toBe(604800);
    expect(parseGrace("1 day")).toBeNull();
    expect(parseGrace("")).toBeNull();
  });
});
