import type { RunStatusJson } from "@tether/client";

export { formatMicros } from "@tether/react";

export const STATUSES: RunStatusJson[] = [
  "RUN_STATUS_QUEUED",
  "RUN_STATUS_RUNNING",
  "RUN_STATUS_RETRY_PENDING",
  "RUN_STATUS_WAITING_FOR_QUESTION",
  "RUN_STATUS_WAITING_FOR_APPROVAL",
  "RUN_STATUS_WAITING_FOR_CONNECTION",
  "RUN_STATUS_WAITING_FOR_TIMER",
  "RUN_STATUS_WAITING_FOR_CHILDREN",
  "RUN_STATUS_COMPLETED",
  "RUN_STATUS_FAILED",
  "RUN_STATUS_CANCELLED",
];

/** "RUN_STATUS_WAITING_FOR_QUESTION" -> "waiting for question". */
export function statusWords(status: string | undefined): string {
  return (status ?? "RUN_STATUS_UNSPECIFIED").replace("RUN_STATUS_", "").toLowerCase().replace(/_/g, " ");
}

export function statusClass(status: string | undefined): string {
  return `status status-${(status ?? "").replace("RUN_STATUS_", "").toLowerCase().replace(/_/g, "-")}`;
}

/** "12 s", "5 min", "3 h", "2 d" ago. */
export function age(iso: string | undefined, now: number): string {
  if (!iso) return "";
  const s = Math.max(0, Math.round((now - Date.parse(iso)) / 1000));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h`;
  return `${Math.floor(s / 86400)} d`;
}

export function ms(value: number | undefined): string {
  if (value === undefined) return "";
  return value >= 1000 ? `${(value / 1000).toFixed(2)} s` : `${Math.round(value)} ms`;
}

export function tokens(n: string | number | undefined): string {
  return Number(n ?? 0).toLocaleString("en");
}
