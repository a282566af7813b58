/** What the channels pages say about a connection and build from a form, kept apart from React to be tested. */
import type { AddChannelRequestJson, ChannelInfoJson } from "@tether/client";

export type Kind = "slack" | "whatsapp" | "webhook";
export const KINDS: Kind[] = ["slack", "whatsapp", "webhook"];

/** A form field: the CLI's option, the request field it fills, and whether it is a secret. */
export interface Field {
  /** The request's field (in ChannelSecrets, ChannelSettings or the request itself). */
  name: string;
  label: string;
  where: "secrets" | "settings" | "request";
  required: boolean;
  hint?: string;
}

// The same fields as `tether channels add KIND` (libs/tether/cli/channels.py), in its order.
export const FIELDS: Record<Kind, Field[]> = {
  slack: [
    { name: "signingSecret", label: "Signing secret", where: "secrets", required: true },
    { name: "botToken", label: "Bot token", where: "secrets", required: true },
    { name: "apiBaseUrl", label: "API base URL", where: "request", required: false, hint: "empty: Slack's own" },
  ],
  whatsapp: [
    { name: "appSecret", label: "App secret", where: "secrets", required: true },
    { name: "verifyToken", label: "Verify token", where: "secrets", required: true },
    { name: "accessToken", label: "Access token", where: "secrets", required: true },
    { name: "phoneNumberId", label: "Phone number id", where: "settings", required: true },
    { name: "apiBaseUrl", label: "API base URL", where: "request", required: false, hint: "empty: the Graph API's own" },
  ],
  webhook: [
    { name: "secret", label: "Secret", where: "secrets", required: true, hint: "the Standard Webhooks secret (whsec_...)" },
    { name: "textField", label: "Text field", where: "settings", required: true, hint: "a JSON pointer into the body, e.g. /text" },
    { name: "threadField", label: "Thread field", where: "settings", required: true, hint: "e.g. /thread" },
    { name: "senderField", label: "Sender field", where: "settings", required: true, hint: "e.g. /sender" },
    { name: "eventIdField", label: "Event id field", where: "settings", required: true, hint: "e.g. /id" },
    { name: "replyUrl", label: "Reply URL", where: "request", required: false, hint: "where replies are posted" },
  ],
};

/** The AddChannel body for a kind's form values; empty optional fields are left out. */
export function addRequest(kind: Kind, name: string, agent: string, values: Record<string, string>): AddChannelRequestJson {
  const secrets: Record<string, string> = {};
  const settings: Record<string, string> = {};
  const request: Record<string, string> = {};
  for (const field of FIELDS[kind]) {
    const value = field.where === "secrets" ? values[field.name] ?? "" : (values[field.name] ?? "").trim();
    if (!value) continue;
    ({ secrets, settings, request })[field.where][field.name] = value;
  }
  const body: AddChannelRequestJson = { kind, name: name.trim(), secrets, ...request };
  if (agent.trim()) body.agent = agent.trim();
  if (Object.keys(settings).length > 0) body.settings = settings;
  return body;
}

/** Each secret as the API shows it: "signing_secret …cret". Never more than the last four. */
export function secretHints(channel: ChannelInfoJson): string[] {
  return (channel.secrets ?? []).map((s) => (s.lastFour ? `${s.name} …${s.lastFour}` : `${s.name ?? ""}`));
}

/** Whether the secret a rotation replaced still verifies, and until when, in words. */
export function previousSecret(channel: ChannelInfoJson, now: number): string {
  const until = channel.previousSecretExpiresAt;
  if (!until) return "none";
  const at = Date.parse(until);
  if (Number.isNaN(at) || at <= now) return "none (its grace has ended)";
  return `verifies until ${new Date(at).toISOString().replace(".000Z", "Z")}`;
}

const UNIT_SECONDS: Record<string, number> = { s: 1, m: 60, h: 3600, d: 86400 };

/** Seconds of a grace such as 90s, 30m, 24h or 7d (as the CLI's --grace); null when it is not one. */
export function parseGrace(text: string): number | null {
  const found = /^(\d+)([smhd])$/.exec(text.trim());
  if (!found) return null;
  return Number(found[1]) * UNIT_SECONDS[found[2]!]!;
}

/** Where the connection's replies go. */
export function target(channel: ChannelInfoJson): string {
  return channel.apiBaseUrl || channel.replyUrl || "";
}
