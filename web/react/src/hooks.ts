/**
 * React hooks over @tether/client in the shape of the spec's pause table: a run's live state,
 * the live run list, the pending-interaction reads and their answers, the console's session.
 */
import {
  createContext,
  createElement,
  useCallback,
  useContext,
  useEffect,
  useMemo,
  useRef,
  useState,
  type ReactNode,
} from "react";
import {
  initialRunState,
  reduceRun,
  TetherError,
  type AnswerQuestionResponseJson,
  type DecideApprovalResponseJson,
  type PendingApprovalJson,
  type PendingConnectionJson,
  type PendingQuestionJson,
  type QuestionAnswerJson,
  type RunJson,
  type RunState,
  type RunStatusJson,
  type SessionJson,
  type TetherClient,
} from "@tether/client";

const ClientContext = createContext<TetherClient | null>(null);

/** Makes `client` the one the hooks below use. */
export function TetherProvider(props: { client: TetherClient; children?: ReactNode }) {
  return createElement(ClientContext.Provider, { value: props.client }, props.children);
}

export function useTetherClient(): TetherClient {
  const client = useContext(ClientContext);
  if (!client) throw new Error("wrap the tree in <TetherProvider client={...}>");
  return client;
}

function asTetherError(exc: unknown): TetherError {
  if (exc instanceof TetherError) return exc;
  return new TetherError(0, "UNKNOWN", "unknown", exc instanceof Error ? exc.message : String(exc));
}

const PENDING_READ: Partial<Record<RunStatusJson, "question" | "approval" | "connection">> = {
  RUN_STATUS_WAITING_FOR_QUESTION: "question",
  RUN_STATUS_WAITING_FOR_APPROVAL: "approval",
  RUN_STATUS_WAITING_FOR_CONNECTION: "connection",
};

export interface UseRunOptions {
  /** Resume after this durable seq (a cursor kept across a reload). */
  after?: number;
  /** Whether to receive text deltas (default true). */
  deltas?: boolean;
  /** Called with the cursor after every durable event, to keep it (e.g. in sessionStorage). */
  onCursor?: (seq: number) => void;
}

export interface UseRun {
  state: RunState;
  /** The error that ended the stream (not found, permission), or null. */
  error: TetherError | null;
}

/**
 * A run's live state: snapshot, parts as they stream, retry and pending interaction, resumed
 * from the cursor after breaks without losing or repeating an event.
 */
export function useRun(runId: string | null | undefined, options: UseRunOptions = {}): UseRun {
  const client = useTetherClient();
  const [state, setState] = useState<RunState>(initialRunState);
  const [error, setError] = useState<TetherError | null>(null);
  const onCursor = useRef(options.onCursor);
  onCursor.current = options.onCursor;
  // The cursor to start from is read when the run changes, not on every render.
  const afterRef = useRef(options.after);
  afterRef.current = options.after;
  const { deltas } = options;

  useEffect(() => {
    if (!runId) return undefined;
    const abort = new AbortController();
    const after = afterRef.current;
    let current: RunState = { ...initialRunState, lastSeq: after ?? 0 };
    setState(current);
    setError(null);
    (async () => {
      try {
        const opts = { signal: abort.signal, ...(deltas === undefined ? {} : { deltas }) };
        for await (const item of client.streamRun(runId, { ...opts, ...(after ? { after } : {}) })) {
          if (abort.signal.aborted) return;
          const before = current.lastSeq;
          current = reduceRun(current, item);
          setState(current);
          if (current.lastSeq !== before) onCursor.current?.(current.lastSeq);
          if (item.kind === "snapshot") {
            // Parked before the cursor: the thin event is not replayed, so read the pending one.
            const kind = PENDING_READ[item.run.status as RunStatusJson];
            if (kind && !current.pending) {
              const pending = await readPending(client, runId, kind, abort.signal);
              if (abort.signal.aborted) return;
              current = { ...current, pending };
              setState(current);
            }
          }
        }
        if (!abort.signal.aborted) {
          current = { ...current, connection: "ended" };
          setState(current);
        }
      } catch (exc) {
        if (abort.signal.aborted) return;
        setError(asTetherError(exc));
        setState((s) => ({ ...s, connection: "ended" }));
      }
    })();
    return () => abort.abort();
  }, [client, runId, deltas]);

  return { state, error };
}

async function readPending(client: TetherClient, runId: string, kind: "question" | "approval" | "connection", signal: AbortSignal): Promise<RunState["pending"]> {
  try {
    if (kind === "question") return { type: "question", question: (await client.getPendingQuestion(runId, { signal })).question ?? null };
    if (kind === "approval") return { type: "approval", approval: (await client.getPendingApproval(runId, { signal })).approval ?? null };
    return { type: "connection", connection: (await client.getPendingConnection(runId, { signal })).connection ?? null };
  } catch {
    return null;
  }
}

export interface UseRunsOptions {
  statuses?: RunStatusJson[];
  conversationId?: string;
  pageSize?: number;
}

/** The live run list: newest first, updated as runs change; filtered as asked. */
export function useRuns(options: UseRunsOptions = {}): { runs: RunJson[]; error: TetherError | null; live: boolean } {
  const client = useTetherClient();
  const [runs, setRuns] = useState<RunJson[]>([]);
  const [error, setError] = useState<TetherError | null>(null);
  const [live, setLive] = useState(false);
  const statusKey = (options.statuses ?? []).join(",");
  const { conversationId, pageSize } = options;

  useEffect(() => {
    const abort = new AbortController();
    const statuses = statusKey ? (statusKey.split(",") as RunStatusJson[]) : [];
    const matches = (run: RunJson) =>
      (statuses.length === 0 || statuses.includes(run.status as RunStatusJson)) &&
      (!conversationId || run.conversationId === conversationId);
    setError(null);
    (async () => {
      try {
        const query = { signal: abort.signal, statuses, ...(conversationId ? { conversationId } : {}), ...(pageSize ? { pageSize } : {}) };
        for await (const item of client.streamRuns(query)) {
          if (abort.signal.aborted) return;
          if (item.kind === "runs") {
            setRuns((item.page.runs ?? []).filter(matches));
            setLive(true);
          } else if (item.kind === "run") {
            setRuns((list) => upsertRun(list, item.run, matches(item.run)));
          } else {
            setLive(false);
          }
        }
      } catch (exc) {
        if (!abort.signal.aborted) {
          setError(asTetherError(exc));
          setLive(false);
        }
      }
    })();
    return () => abort.abort();
  }, [client, statusKey, conversationId, pageSize]);

  return { runs, error, live };
}

/** Replaces a run by id (or adds it), newest first; drops it when it no longer matches. */
export function upsertRun(list: RunJson[], run: RunJson, keep: boolean): RunJson[] {
  const rest = list.filter((r) => r.runId !== run.runId);
  if (!keep) return rest;
  rest.push(run);
  rest.sort((a, b) => (b.createdAt ?? "").localeCompare(a.createdAt ?? "") || (b.runId ?? "").localeCompare(a.runId ?? ""));
  return rest;
}

interface PendingRead<T> {
  data: T | null;
  loading: boolean;
  error: TetherError | null;
  reload: () => void;
}

function usePending<T>(runId: string | null | undefined, read: (client: TetherClient, runId: string, signal: AbortSignal) => Promise<T | null>, enabled: boolean): PendingRead<T> {
  const client = useTetherClient();
  const [data, setData] = useState<T | null>(null);
  const [loading, setLoading] = useState(false);
  const [error, setError] = useState<TetherError | null>(null);
  const [tick, setTick] = useState(0);
  const readRef = useRef(read);
  readRef.current = read;
  useEffect(() => {
    if (!runId || !enabled) return undefined;
    const abort = new AbortController();
    setLoading(true);
    readRef.current(client, runId, abort.signal).then(
      (value) => {
        if (abort.signal.aborted) return;
        setData(value);
        setError(null);
        setLoading(false);
      },
      (exc: unknown) => {
        if (abort.signal.aborted) return;
        setError(asTetherError(exc));
        setLoading(false);
      },
    );
    return () => abort.abort();
  }, [client, runId, enabled, tick]);
  const reload = useCallback(() => setTick((t) => t + 1), []);
  return { data, loading, error, reload };
}

/** The run's open question (null when none or answered). */
export function usePendingQuestion(runId: string | null | undefined, options: { enabled?: boolean } = {}) {
  const r = usePending<PendingQuestionJson>(runId, async (c, id, signal) => (await c.getPendingQuestion(id, { signal })).question ?? null, options.enabled ?? true);
  return { question: r.data, loading: r.loading, error: r.error, reload: r.reload };
}

/** The run's open approval (null when none or decided). */
export function usePendingApproval(runId: string | null | undefined, options: { enabled?: boolean } = {}) {
  const r = usePending<PendingApprovalJson>(runId, async (c, id, signal) => (await c.getPendingApproval(id, { signal })).approval ?? null, options.enabled ?? true);
  return { approval: r.data, loading: r.loading, error: r.error, reload: r.reload };
}

/** The run's open connection offer (null when none or completed). */
export function usePendingConnection(runId: string | null | undefined, options: { enabled?: boolean } = {}) {
  const r = usePending<PendingConnectionJson>(runId, async (c, id, signal) => (await c.getPendingConnection(id, { signal })).connection ?? null, options.enabled ?? true);
  return { connection: r.data, loading: r.loading, error: r.error, reload: r.reload };
}

export interface Mutation<A extends unknown[], R> {
  /** Runs the call once; a second call while one is in flight or after success does nothing. */
  run: (...args: A) => Promise<R | null>;
  submitting: boolean;
  result: R | null;
  error: TetherError | null;
}

function useOnce<A extends unknown[], R>(call: (...args: A) => Promise<R>, key: unknown): Mutation<A, R> {
  const [submitting, setSubmitting] = useState(false);
  const [result, setResult] = useState<R | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const busy = useRef(false);
  const done = useRef(false);
  const callRef = useRef(call);
  callRef.current = call;
  useEffect(() => {
    busy.current = false;
    done.current = false;
    setResult(null);
    setError(null);
    setSubmitting(false);
  }, [key]);
  const run = useCallback(async (...args: A): Promise<R | null> => {
    if (busy.current || done.current) return null;
    busy.current = true;
    setSubmitting(true);
    setError(null);
    try {
      const value = await callRef.current(...args);
      done.current = true;
      setResult(value);
      return value;
    } catch (exc) {
      setError(asTetherError(exc));
      return null;
    } finally {
      busy.current = false;
      setSubmitting(false);
    }
  }, []);
  return { run, submitting, result, error };
}

/** Answers the run's question (keyed by the interaction, so a new question can be answered). */
export function useAnswerQuestion(runId: string, interactionId?: string): Mutation<[Record<string, QuestionAnswerJson>], AnswerQuestionResponseJson> {
  const client = useTetherClient();
  return useOnce((answers: Record<string, QuestionAnswerJson>) => client.answerQuestion(runId, answers), `${runId}/${interactionId ?? ""}`);
}

export type Decision = "allow-once" | "allow-conversation" | "allow-always" | "deny";

/** Decides the run's approval. */
export function useDecideApproval(runId: string, interactionId?: string): Mutation<[Decision, string?], DecideApprovalResponseJson> {
  const client = useTetherClient();
  return useOnce(
    (decision: Decision, alwaysScope?: string) =>
      client.decideApproval(runId, { decision, ...(decision === "allow-always" ? { alwaysScope: alwaysScope ?? "principal" } : {}) }),
    `${runId}/${interactionId ?? ""}`,
  );
}

export interface UseSession {
  session: SessionJson | null;
  /** True until the first GET /v2/session answered. */
  loading: boolean;
  error: TetherError | null;
  signIn: (apiKey: string) => Promise<boolean>;
  signOut: () => Promise<void>;
}

/** The console's cookie session: read on load, signed in with an API key, signed out. */
export function useSession(): UseSession {
  const client = useTetherClient();
  const [session, setSession] = useState<SessionJson | null>(null);
  const [loading, setLoading] = useState(true);
  const [error, setError] = useState<TetherError | null>(null);
  useEffect(() => {
    let live = true;
    client.getSession().then(
      (s) => live && (setSession(s), setLoading(false)),
      (exc: unknown) => {
        if (!live) return;
        const e = asTetherError(exc);
        if (e.status !== "UNAUTHENTICATED") setError(e);
        setLoading(false);
      },
    );
    return () => {
      live = false;
    };
  }, [client]);
  const signIn = useCallback(async (apiKey: string) => {
    setError(null);
    try {
      setSession(await client.signIn(apiKey));
      return true;
    } catch (exc) {
      setError(asTetherError(exc));
      return false;
    }
  }, [client]);
  const signOut = useCallback(async () => {
    try {
      await client.signOut();
    } catch (exc) {
      const e = asTetherError(exc);
      if (e.status !== "UNAUTHENTICATED") {
        setError(e);
        return;
      }
    }
    setSession(null);
  }, [client]);
  return useMemo(() => ({ session, loading, error, signIn, signOut }), [session, loading, error, signIn, signOut]);
}
