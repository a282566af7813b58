/**
 * The bridge's server-sent event streams, read with fetch() (so a bearer token can be sent),
 * reconnecting by themselves: from the run's last durable seq (Last-Event-ID) after a network
 * break, a stream that ended early, or an `event: error` frame, never yielding a durable event
 * twice and never skipping one.
 */
import type { PartJson, RunJson } from "./gen/tether/v1/common_pb.js";
import type { RunEventJson } from "./gen/tether/v1/events_pb.js";
import type {
  ListRunsResponseJson,
  StreamConversationResponseJson,
  StreamRunResponseJson,
} from "./gen/tether/v1/gateway_pb.js";
import type {
  PendingApprovalJson,
  PendingConnectionJson,
  PendingQuestionJson,
} from "./gen/tether/v1/interactions_pb.js";
import type { RunStatusJson } from "./gen/tether/v1/common_pb.js";
import { isAbort, listQuery, runPath, type TetherClient } from "./client.js";
import { TetherError } from "./errors.js";
import { readSse, type SseFrame } from "./sse.js";

/** A thin interaction event resolved through its pending-* read (null once resolved). */
export type Pending =
  | { type: "question"; question: PendingQuestionJson | null }
  | { type: "approval"; approval: PendingApprovalJson | null }
  | { type: "connection"; connection: PendingConnectionJson | null };

/** The stream is about to reconnect (a break, or the server ended it early). */
export interface Reconnecting {
  kind: "reconnecting";
  /** Consecutive failed tries, from 1. */
  attempt: number;
  delayMs: number;
  error: unknown;
}

export type RunStreamItem =
  | { kind: "snapshot"; run: RunJson; parts: PartJson[]; resumed: boolean }
  | { kind: "event"; event: RunEventJson; pending?: Pending }
  | Reconnecting;

export interface RunStreamOptions {
  /** Resume after this durable seq (a cursor kept from an earlier stream); 0 for the whole log. */
  after?: number | string;
  /** Whether to receive ephemeral text deltas (default true). */
  deltas?: boolean;
  /** Whether to resolve thin interaction events through the pending-* reads (default true). */
  resolvePending?: boolean;
  signal?: AbortSignal;
}

export type ConversationStreamItem =
  | { kind: "event"; event: RunEventJson; cursor: string }
  | Reconnecting;

export interface ConversationStreamOptions {
  cursor?: string;
  deltas?: boolean;
  signal?: AbortSignal;
}

export type LiveRunsItem =
  | { kind: "runs"; page: ListRunsResponseJson }
  | { kind: "run"; run: RunJson }
  | Reconnecting;

export interface LiveRunsOptions {
  statuses?: RunStatusJson[];
  conversationId?: string;
  pageSize?: number;
  signal?: AbortSignal;
}

export const TERMINAL_EVENTS = new Set(["run.completed", "run.failed", "run.cancelled"]);
export const TERMINAL_STATUSES = new Set<RunStatusJson>([
  "RUN_STATUS_COMPLETED",
  "RUN_STATUS_FAILED",
  "RUN_STATUS_CANCELLED",
]);

/** One connection's frames; an `event: error` frame is thrown as its TetherError. */
async function* connect(
  client: TetherClient,
  path: string,
  lastEventId: string | undefined,
  signal: AbortSignal | undefined,
): AsyncGenerator<SseFrame> {
  const headers: Record<string, string> = { Accept: "text/event-stream" };
  if (lastEventId) headers["Last-Event-ID"] = lastEventId;
  const init: { headers: Record<string, string>; signal?: AbortSignal } = { headers };
  if (signal) init.signal = signal;
  const response = await client.send("GET", path, init);
  if (!response.body) throw new TetherError(0, "NETWORK", "network", "the stream has no body");
  try {
    for await (const frame of readSse(response.body)) {
      if (frame.event === "error") {
        let body: unknown;
        try {
          body = JSON.parse(frame.data);
        } catch {
          body = undefined;
        }
        throw TetherError.fromBody(0, body);
      }
      yield frame;
    }
  } catch (exc) {
    if (exc instanceof TetherError || isAbort(exc) || signal?.aborted) throw exc;
    // A read that broke mid-stream (connection reset, proxy gone): reconnect.
    throw new TetherError(0, "NETWORK", "network", exc instanceof Error ? exc.message : String(exc));
  }
}

/**
 * Runs `attempt` (one connection) until it says the stream is over, reconnecting with backoff
 * after retryable failures. Non-retryable errors (not found, permission, a bad cursor) throw.
 */
async function* reconnecting<T>(
  client: TetherClient,
  signal: AbortSignal | undefined,
  attempt: (progress: () => void, advanced: () => void) => AsyncGenerator<T, boolean>,
): AsyncGenerator<T | Reconnecting> {
  let failures = 0;
  let refreshed = false;
  for (;;) {
    let error: unknown;
    try {
      const done = yield* attempt(
        () => {
          failures = 0;
        },
        () => {
          refreshed = false; // a new token was good for something: the next expiry refreshes too
        },
      );
      if (done) return;
      error = new TetherError(0, "UNAVAILABLE", "stream_ended", "the stream ended before the run did");
    } catch (exc) {
      if (isAbort(exc) || signal?.aborted) return;
      // A short-lived token that expired mid-stream: one fresh token, then reconnect.
      const expired = exc instanceof TetherError && exc.status === "UNAUTHENTICATED" && client.canRefresh() && !refreshed;
      if (!expired && (!(exc instanceof TetherError) || !exc.retryable)) throw exc;
      if (expired) {
        refreshed = true;
        client.invalidateToken();
      }
      error = exc;
    }
    failures += 1;
    const base = Math.min(client.reconnectMaxMs, client.reconnectInitialMs * 2 ** (failures - 1));
    const delayMs = Math.round(base * (0.5 + Math.random() * 0.5));
    yield { kind: "reconnecting", attempt: failures, delayMs, error };
    if (!(await sleep(delayMs, signal))) return;
  }
}

export async function* runStream(
  client: TetherClient,
  runId: string,
  options: RunStreamOptions,
): AsyncGenerator<RunStreamItem> {
  let cursor = Number(options.after ?? 0);
  let connections = 0;
  const query = options.deltas === false ? "?deltas=false" : "";
  const path = `${runPath(runId)}/events${query}`;
  yield* reconnecting<RunStreamItem>(client, options.signal, async function* (progress, advanced) {
    const resumed = connections++ > 0;
    let terminal = false;
    for await (const frame of connect(client, path, cursor > 0 ? String(cursor) : undefined, options.signal)) {
      progress();
      const data = JSON.parse(frame.data) as StreamRunResponseJson;
      if (data.snapshot) {
        const run = data.snapshot.run ?? {};
        terminal = TERMINAL_STATUSES.has(run.status as RunStatusJson) && Number(run.lastSeq ?? 0) <= cursor;
        yield { kind: "snapshot", run, parts: data.snapshot.parts ?? [], resumed };
        continue;
      }
      const events = data.event ? [data.event] : (data.batch?.events ?? []);
      for (const event of events) {
        const seq = Number(event.seq ?? 0);
        if (seq > 0 && seq <= cursor) continue; // delivered before the break
        const item: RunStreamItem = { kind: "event", event };
        if (options.resolvePending !== false) {
          const pending = await resolvePending(client, runId, event, options.signal);
          if (pending) item.pending = pending;
        }
        if (seq > 0) {
          cursor = seq;
          advanced();
        }
        if (TERMINAL_EVENTS.has(event.type ?? "")) terminal = true;
        yield item;
      }
    }
    return terminal;
  });
}

/** The read behind a thin interaction event, so a client never renders a bare id. */
export async function resolvePending(
  client: TetherClient,
  runId: string,
  event: RunEventJson,
  signal?: AbortSignal,
): Promise<Pending | undefined> {
  const opts = signal ? { signal } : {};
  switch (event.type) {
    case "question.requested":
      return { type: "question", question: (await client.getPendingQuestion(runId, opts)).question ?? null };
    case "approval.requested":
      return { type: "approval", approval: (await client.getPendingApproval(runId, opts)).approval ?? null };
    case "connection.requested":
      return { type: "connection", connection: (await client.getPendingConnection(runId, opts)).connection ?? null };
    default:
      return undefined;
  }
}

export async function* conversationStream(
  client: TetherClient,
  conversationId: string,
  options: ConversationStreamOptions,
): AsyncGenerator<ConversationStreamItem> {
  let cursor = options.cursor ?? "";
  const seen = new Map<string, number>();
  const query = options.deltas === false ? "?deltas=false" : "";
  const path = `/v2/conversations/${encodeURIComponent(conversationId)}/events${query}`;
  yield* reconnecting<ConversationStreamItem>(client, options.signal, async function* (progress, advanced) {
    for await (const frame of connect(client, path, cursor || undefined, options.signal)) {
      progress();
      const data = JSON.parse(frame.data) as StreamConversationResponseJson;
      if (!data.event) continue;
      const event = data.event;
      const seq = Number(event.seq ?? 0);
      const runId = event.runId ?? "";
      if (seq > 0 && seq <= (seen.get(runId) ?? 0)) continue;
      if (seq > 0) {
        seen.set(runId, seq);
        advanced();
      }
      if (data.cursor) cursor = data.cursor;
      else if (frame.hasId) cursor = frame.id;
      yield { kind: "event", event, cursor };
    }
    return false; // a conversation has no end: reconnect
  });
}

export async function* liveRuns(
  client: TetherClient,
  options: LiveRunsOptions,
): AsyncGenerator<LiveRunsItem> {
  const path = `/v2/runs/live${listQuery(options)}`;
  yield* reconnecting<LiveRunsItem>(client, options.signal, async function* (progress, advanced) {
    // Each connection starts with a fresh page, so nothing changed while away is missed.
    for await (const frame of connect(client, path, undefined, options.signal)) {
      progress();
      const data = JSON.parse(frame.data) as { page?: ListRunsResponseJson; run?: RunJson } & ListRunsResponseJson;
      if (data.page) yield { kind: "runs", page: data.page };
      else if (frame.event === "runs") yield { kind: "runs", page: { runs: data.runs ?? [], nextPageToken: data.nextPageToken ?? "" } };
      else if (data.run) {
        advanced();
        yield { kind: "run", run: data.run };
      }
    }
    return false;
  });
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve(false);
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve(true);
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      resolve(false);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
