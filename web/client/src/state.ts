/**
 * A run's live state folded from its stream: the same reducer for the React hooks and anyone
 * else. Parts are replaced by index (never appended to), so replaying events the snapshot
 * already holds changes nothing.
 */
import type {
  DeliveryJson,
  ErrorInfoJson,
  PartJson,
  RunJson,
  RunStatusJson,
  UsageJson,
} from "./gen/tether/v1/common_pb.js";
import type { RunEventJson } from "./gen/tether/v1/events_pb.js";
import type { Pending, RunStreamItem } from "./streams.js";

export interface RetryInfo {
  /** The attempt that failed. */
  attempt: number;
  maxAttempts: number;
  /** RFC 3339 time of the next attempt. */
  nextAttemptAt: string;
  error?: ErrorInfoJson;
}

export interface RunState {
  run: RunJson | null;
  /** Parts by index, in order; superseded ones removed. */
  parts: PartJson[];
  /** The last durable seq applied: the cursor to resume from. */
  lastSeq: number;
  /** The latest run.retry-pending while the run waits for its next attempt. */
  retry: RetryInfo | null;
  /** The open interaction, when the run is parked on one (null once resolved or unknown). */
  pending: Pending | null;
  /** Per-turn usage seen on the stream (usage.updated). */
  turns: UsageJson[];
  /** "connecting", "live", "reconnecting" or "ended". */
  connection: "connecting" | "live" | "reconnecting" | "ended";
  /** Durable events applied, in order (type and seq), for a timeline. */
  events: { seq: number; type: string; createdAt?: string }[];
  superseded: number[];
  /**
   * Live text of a part beyond what this client holds: a stream joined mid-part receives the
   * deltas after its join, while the text before them is durable only at the part's next
   * checkpoint (part.updated). By part index: the byte offset the tail starts at, and the tail.
   */
  tails: Record<number, { from: number; text: string }>;
}

export const initialRunState: RunState = {
  run: null,
  parts: [],
  lastSeq: 0,
  retry: null,
  pending: null,
  turns: [],
  connection: "connecting",
  events: [],
  superseded: [],
  tails: {},
};

/** A part's text as far as it is known: the held text, then "…" and the live tail after a gap. */
export function partText(state: RunState, part: PartJson): string {
  const text = part.text?.text ?? "";
  const tail = state.tails[part.index ?? 0];
  return tail ? `${text}${text ? " " : ""}… ${tail.text}` : text;
}

const WAITING: Record<string, RunStatusJson> = {
  "question.requested": "RUN_STATUS_WAITING_FOR_QUESTION",
  "approval.requested": "RUN_STATUS_WAITING_FOR_APPROVAL",
  "connection.requested": "RUN_STATUS_WAITING_FOR_CONNECTION",
};

function putPart(parts: PartJson[], part: PartJson | undefined): PartJson[] {
  if (!part) return parts;
  const index = part.index ?? 0;
  const next = parts.filter((p) => (p.index ?? 0) !== index);
  next.push(part);
  next.sort((a, b) => (a.index ?? 0) - (b.index ?? 0));
  return next;
}

/**
 * The part this client already holds when it is ahead of a (re)connect's snapshot: a streaming
 * text part whose live text continues the snapshot's checkpointed text. A reconnect then keeps
 * what it showed instead of going back to the last checkpoint.
 */
function aheadOf(held: PartJson[], snap: PartJson): PartJson | undefined {
  const mine = held.find((p) => (p.index ?? 0) === (snap.index ?? 0));
  if (!mine || snap.final || mine.text === undefined || snap.text === undefined) return undefined;
  const have = mine.text.text ?? "";
  const theirs = snap.text.text ?? "";
  return have.length > theirs.length && have.startsWith(theirs) ? mine : undefined;
}

function utf8Length(text: string): number {
  return new TextEncoder().encode(text).length;
}

/** Applies one stream item. */
export function reduceRun(state: RunState, item: RunStreamItem): RunState {
  if (item.kind === "reconnecting") return { ...state, connection: "reconnecting" };
  if (item.kind === "snapshot") {
    const run = item.run;
    const waiting = run.status?.startsWith("RUN_STATUS_WAITING_FOR_") ?? false;
    return {
      ...state,
      run,
      parts: item.parts
        .filter((p) => !state.superseded.includes(p.index ?? 0))
        .map((p) => aheadOf(state.parts, p) ?? p)
        .sort((a, b) => (a.index ?? 0) - (b.index ?? 0)),
      retry: run.status === "RUN_STATUS_RETRY_PENDING" && run.nextAttemptAt
        ? { attempt: run.attempt ?? 1, maxAttempts: run.maxAttempts ?? 1, nextAttemptAt: run.nextAttemptAt, ...(run.error ? { error: run.error } : {}) }
        : null,
      pending: waiting ? state.pending : null,
      // The cursor stays: the events after it follow (and replace what the snapshot holds).
      lastSeq: state.lastSeq,
      connection: "live",
    };
  }
  return applyEvent({ ...state, connection: "live" }, item.event, item.pending);
}

export function applyEvent(state: RunState, event: RunEventJson, pending?: Pending): RunState {
  const seq = Number(event.seq ?? 0);
  if (seq > 0 && seq <= state.lastSeq) return state;
  let next: RunState = { ...state };
  if (seq > 0) {
    next.lastSeq = seq;
    const entry: { seq: number; type: string; createdAt?: string } = { seq, type: event.type ?? "" };
    if (event.createdAt) entry.createdAt = event.createdAt;
    next.events = [...state.events, entry];
  }
  const run: RunJson = { ...(state.run ?? {}) };
  if (seq > 0) run.lastSeq = String(seq);
  if (event.createdAt && seq > 0) run.updatedAt = event.createdAt;
  switch (event.type) {
    case "part.added":
    case "part.updated": {
      const part = event.type === "part.added" ? event.partAdded?.part : event.partUpdated?.part;
      next.parts = putPart(state.parts, part);
      const index = part?.index ?? 0;
      const tail = state.tails[index];
      if (part && tail && utf8Length(part.text?.text ?? "") >= tail.from) {
        const { [index]: _caught, ...rest } = state.tails;
        next.tails = rest; // the durable text caught up with the tail
      }
      break;
    }
    case "part.superseded": {
      const index = event.partSuperseded?.partIndex ?? 0;
      next.parts = state.parts.filter((p) => (p.index ?? 0) !== index);
      next.superseded = [...state.superseded, index];
      break;
    }
    case "text.delta": {
      const d = event.textDelta;
      const index = d?.partIndex ?? 0;
      if (!d || state.superseded.includes(index)) break;
      const part = state.parts.find((p) => (p.index ?? 0) === index);
      if (!part) {
        if (Number(d.offset ?? 0) === 0) {
          next.parts = putPart(state.parts, { index, role: "assistant", text: { text: d.text ?? "" } });
        }
        break;
      }
      const text = part.text?.text ?? "";
      const offset = Number(d.offset ?? 0);
      const held = utf8Length(text);
      const tail = state.tails[index];
      if (part.text === undefined || offset < held) break; // not text, or held already
      if (offset === held && !tail) {
        next.parts = putPart(state.parts, { ...part, text: { text: text + (d.text ?? "") } });
      } else if (tail && tail.from + utf8Length(tail.text) === offset) {
        next.tails = { ...state.tails, [index]: { from: tail.from, text: tail.text + (d.text ?? "") } };
      } else if (!tail) {
        next.tails = { ...state.tails, [index]: { from: offset, text: d.text ?? "" } };
      }
      break;
    }
    case "run.queued":
      run.status = "RUN_STATUS_QUEUED";
      if (event.runQueued?.attempt) run.attempt = event.runQueued.attempt;
      next.pending = null;
      break;
    case "run.started":
      run.status = "RUN_STATUS_RUNNING";
      if (event.runStarted?.attempt) run.attempt = event.runStarted.attempt;
      next.retry = null;
      break;
    case "run.retry-pending": {
      const r = event.runRetryPending;
      run.status = "RUN_STATUS_RETRY_PENDING";
      if (r) {
        next.retry = {
          attempt: r.attempt ?? 1,
          maxAttempts: r.maxAttempts ?? 1,
          nextAttemptAt: r.nextAttemptAt ?? "",
          ...(r.error ? { error: r.error } : {}),
        };
        if (r.nextAttemptAt) run.nextAttemptAt = r.nextAttemptAt;
        if (r.maxAttempts) run.maxAttempts = r.maxAttempts;
      }
      break;
    }
    case "run.completed":
      run.status = "RUN_STATUS_COMPLETED";
      if (event.runCompleted?.resultText !== undefined) run.resultText = event.runCompleted.resultText;
      if (event.runCompleted?.usage) run.usage = event.runCompleted.usage;
      next.retry = null;
      next.pending = null;
      break;
    case "run.failed":
      run.status = "RUN_STATUS_FAILED";
      if (event.runFailed?.error) run.error = event.runFailed.error;
      next.retry = null;
      next.pending = null;
      break;
    case "run.cancelled":
      run.status = "RUN_STATUS_CANCELLED";
      next.retry = null;
      next.pending = null;
      break;
    case "question.requested":
    case "approval.requested":
    case "connection.requested":
      run.status = WAITING[event.type] ?? "RUN_STATUS_UNSPECIFIED";
      next.pending = pending ?? null;
      break;
    case "question.answered":
    case "approval.decided":
    case "connection.completed":
      next.pending = null;
      break;
    case "timer.set":
      // Parked by its wait_until call, holding no worker, until the due time.
      run.status = "RUN_STATUS_WAITING_FOR_TIMER";
      if (event.timerSet?.dueAt) run.nextWakeAt = event.timerSet.dueAt;
      next.pending = null;
      break;
    case "timer.fired":
      // Queued again (run.queued follows): nothing is due any more.
      delete run.nextWakeAt;
      break;
    case "delivery.sent":
    case "delivery.failed":
    case "delivery.unknown":
    case "delivery.denied": {
      // A channel run's answer reached its outcome (before run.completed): the task outcome.
      const d = event.deliverySent ?? event.deliveryFailed ?? event.deliveryUnknown ?? event.deliveryDenied;
      const delivery: DeliveryJson = { ...(run.delivery ?? {}), state: event.type.slice("delivery.".length) };
      if (d?.deliveryId) delivery.deliveryId = d.deliveryId;
      if (d?.channelId) delivery.channelId = d.channelId;
      if (d?.kind) delivery.kind = d.kind;
      if (d?.providerMessageId) delivery.providerMessageId = d.providerMessageId;
      if (d?.error) delivery.error = d.error;
      run.delivery = delivery;
      break;
    }
    case "usage.updated":
      if (event.usageUpdated?.total) run.usage = event.usageUpdated.total;
      if (event.usageUpdated?.turn) next.turns = [...state.turns, event.usageUpdated.turn];
      break;
    case "keepalive":
      if (event.keepalive?.status) run.status = event.keepalive.status;
      break;
    default:
      break;
  }
  next.run = run;
  return next;
}
