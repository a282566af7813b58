/** What the Schedules page shows and sends: the add request as the CLI builds it, and when each fires next. */
import type { AddScheduleRequestJson, ScheduleJson } from "@tether/client";

export const OVERLAPS = ["skip", "allow"] as const;
export const CATCH_UPS = ["latest", "none", "all"] as const;

export type ScheduleForm = {
  agent: string;
  cron: string;
  timezone: string;
  message: string;
  overlap: string;
  catchUp: string;
  /** A duration as the CLI takes it: 90s, 15m, 6h, 2d (empty: the default hour). */
  window: string;
};

const UNITS: Record<string, number> = { s: 1, m: 60, h: 3600, d: 86400 };

/** Seconds from "90", "90s", "15m", "6h" or "2d"; null when it is none of those. */
export function parseDuration(text: string): number | null {
  const found = /^(\d+)([smhd]?)$/.exec(text.trim());
  if (!found) return null;
  return Number(found[1]) * UNITS[found[2] || "s"]!;
}

/** The AddSchedule body; the server refuses what is wrong (cron, timezone, agent, policy) by name. */
export function addRequest(form: ScheduleForm): AddScheduleRequestJson {
  const body: AddScheduleRequestJson = {
    agent: form.agent.trim(),
    cron: form.cron.trim(),
    timezone: form.timezone.trim() || "UTC",
    message: form.message,
    overlap: form.overlap,
    catchUp: form.catchUp,
  };
  const window = form.window.trim() ? parseDuration(form.window) : 0;
  if (window === null) throw new Error(`"${form.window}" is not a duration; write e.g. 90s, 15m, 6h or 2d`);
  if (window) body.catchUpWindowSeconds = String(window);
  return body;
}

/** When a schedule fires next, in its own timezone and in UTC; "paused" while paused. */
export function nextFire(schedule: ScheduleJson): string {
  if (schedule.paused || !schedule.nextFireAt) return "paused";
  const at = new Date(schedule.nextFireAt);
  const local = at.toLocaleString("en-GB", {
    timeZone: schedule.timezone || "UTC",
    weekday: "short",
    day: "numeric",
    month: "short",
    hour: "2-digit",
    minute: "2-digit",
  });
  return `${local} ${schedule.timezone || "UTC"} (${at.toISOString().slice(0, 16).replace("T", " ")} UTC)`;
}

/** The policies in the CLI's words: "skip, latest" or "allow, all within 6 h". */
export function policies(schedule: ScheduleJson): string {
  const catchUp = schedule.catchUp === "all" ? `all within ${hours(Number(schedule.catchUpWindowSeconds ?? 0))}` : schedule.catchUp;
  return `overlap ${schedule.overlap}, catch-up ${catchUp}`;
}

function hours(seconds: number): string {
  return seconds % 3600 === 0 ? `${seconds / 3600} h` : `${Math.round(seconds / 60)} min`;
}
