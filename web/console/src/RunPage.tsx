import { useCallback, useEffect, useMemo, useState } from "react";
import { TERMINAL_STATUSES, partText, type GetRunAttemptsResponseJson, type PartJson, type RetryInfo, type RunState, type RunStatusJson, type WaitingForJson } from "@tether/client";
import { ApprovalCard, ConnectionCard, QuestionCard, useRun, useTetherClient } from "@tether/react";
import { NotFound, SessionEnded, useNow } from "./App.js";
import { age, formatMicros, ms, statusClass, statusWords, tokens } from "./format.js";
import { href, navigate, onLinkClick } from "./router.js";
import { RunTree } from "./RunTree.js";
import { WaitingFor } from "./WaitingFor.js";

const CURSOR_KEY = "tether.cursor.";
// How often a queued run's page asks again why it waits: a cap frees up as runs end.
const WAITING_POLL_MS = 3000;

function storedCursor(runId: string): number {
  try {
    return Number(window.sessionStorage.getItem(CURSOR_KEY + runId) ?? 0) || 0;
  } catch {
    return 0;
  }
}

export function RunPage({ runId }: { runId: string }) {
  const client = useTetherClient();
  // A reload resumes from the last event this tab saw (the snapshot brings the parts).
  const [after] = useState(() => storedCursor(runId));
  const keep = useCallback((seq: number) => {
    try {
      window.sessionStorage.setItem(CURSOR_KEY + runId, String(seq));
    } catch {
      /* private mode: a reload replays the log instead */
    }
  }, [runId]);
  const { state, error } = useRun(runId, { after, onCursor: keep });
  const run = state.run;
  const [record, setRecord] = useState<GetRunAttemptsResponseJson | null>(null);
  const [actionError, setActionError] = useState<string | null>(null);
  const status = run?.status as RunStatusJson | undefined;
  // The last interaction stays on the page once resolved (by this page or elsewhere), inert.
  const [shown, setShown] = useState<RunState["pending"]>(null);
  useEffect(() => {
    if (state.pending) setShown(state.pending);
  }, [state.pending]);
  const resolvedElsewhere = shown !== null && state.pending === null;
  const terminal = status !== undefined && TERMINAL_STATUSES.has(status);

  // The routing (model) and what holds a queued run back (waitingFor) are on a run read by id,
  // not on the stream's snapshot: read again while it stays queued, as a cap frees up.
  const [model, setModel] = useState<string>("");
  const [waiting, setWaiting] = useState<WaitingForJson | undefined>(undefined);
  const queued = status === "RUN_STATUS_QUEUED";
  useEffect(() => {
    const abort = new AbortController();
    const read = () =>
      client.getRun(runId, { signal: abort.signal }).then((r) => {
        setModel(r.run?.routing?.model ?? "");
        setWaiting(r.run?.waitingFor);
      }, () => undefined);
    void read();
    const every = queued ? window.setInterval(() => void read(), WAITING_POLL_MS) : undefined;
    return () => {
      abort.abort();
      window.clearInterval(every);
    };
  }, [client, runId, run?.attempt, queued]); // eslint-disable-line react-hooks/exhaustive-deps

  // The execution record: read again when the attempt or the status changes.
  useEffect(() => {
    if (!run) return undefined;
    const abort = new AbortController();
    client.getRunAttempts(runId, { signal: abort.signal }).then(setRecord, () => undefined);
    return () => abort.abort();
  }, [client, runId, run?.attempt, status, state.turns.length]); // eslint-disable-line react-hooks/exhaustive-deps

  if (error?.status === "NOT_FOUND") return <NotFound what="run" />;
  if (error?.status === "UNAUTHENTICATED") return <SessionEnded />;
  if (error) return <p className="tether-error" role="alert">{error.message}</p>;
  if (!run) return <p role="status">Loading run…</p>;

  const act = async (what: "cancel" | "retry") => {
    setActionError(null);
    try {
      if (what === "cancel") await client.cancelRun(runId, "cancelled from the console");
      else {
        const out = await client.retryRun(runId);
        if (out.run?.runId) navigate(href({ page: "run", runId: out.run.runId }));
      }
    } catch (exc) {
      setActionError(exc instanceof Error ? exc.message : String(exc));
    }
  };

  return (
    <article aria-labelledby="run-title" className="run">
      <div className="title-row">
        <h1 id="run-title"><code>{run.runId}</code></h1>
        <span className={statusClass(status)} data-testid="run-status">{statusWords(status)}</span>
        <span className={`live ${state.connection === "live" ? "on" : ""}`} role="status" aria-label="Stream">
          {state.connection === "reconnecting" ? "reconnecting…" : state.connection === "ended" ? "ended" : state.connection}
        </span>
      </div>
      <dl className="facts">
        <dt>Conversation</dt><dd>{run.conversationId}</dd>
        <dt>Attempt</dt><dd>{run.attempt ?? 1} of {run.maxAttempts ?? 1}</dd>
        <dt>Model</dt><dd>{run.routing?.model || model || record?.run?.routing?.model || "—"}</dd>
        <dt>Cost</dt><dd data-testid="run-cost">{formatMicros(run.usage?.costMicros)}</dd>
        <dt>Created</dt><dd><time dateTime={run.createdAt}>{run.createdAt ? new Date(run.createdAt).toLocaleString() : ""}</time></dd>
        {run.error && <><dt>Error</dt><dd className="tether-error">{run.error.code}: {run.error.message}</dd></>}
        {run.delivery && (
          <>
            <dt>Reply</dt>
            <dd data-testid="run-delivery" className={run.delivery.error ? "tether-error" : undefined}>
              {run.delivery.state} via {run.delivery.kind} <code>{run.delivery.channelId}</code>
              {run.delivery.providerMessageId && <> (message <code>{run.delivery.providerMessageId}</code>)</>}
              {run.delivery.error && <>: {run.delivery.error.message || run.delivery.error.code}</>}
            </dd>
          </>
        )}
      </dl>
      <div className="actions">
        {!terminal && <button type="button" className="quiet" onClick={() => void act("cancel")}>Cancel run</button>}
        {(status === "RUN_STATUS_FAILED" || status === "RUN_STATUS_CANCELLED") && <button type="button" onClick={() => void act("retry")}>Retry</button>}
        {actionError && <span className="tether-error" role="alert">{actionError}</span>}
      </div>

      {state.retry && status === "RUN_STATUS_RETRY_PENDING" && <RetryIndicator retry={state.retry} />}
      {status === "RUN_STATUS_WAITING_FOR_TIMER" && run.nextWakeAt && (
        <p className="retry" role="status" data-testid="timer-indicator">
          Waiting, holding no worker, until <time dateTime={run.nextWakeAt}>{run.nextWakeAt}</time>
        </p>
      )}
      {queued && <WaitingFor waiting={waiting} />}

      {shown?.type === "question" && shown.question && (
        <QuestionCard key={shown.question.interactionId} runId={runId} question={shown.question} resolvedElsewhere={resolvedElsewhere} />
      )}
      {shown?.type === "approval" && shown.approval && (
        <ApprovalCard key={shown.approval.interactionId} runId={runId} approval={shown.approval} resolvedElsewhere={resolvedElsewhere} />
      )}
      {shown?.type === "connection" && shown.connection && (
        <ConnectionCard key={shown.connection.interactionId} runId={runId} connection={shown.connection} resolvedElsewhere={resolvedElsewhere} />
      )}

      <RunTree runId={runId} rootRunId={run.treeRootRunId} status={status} />

      <section aria-labelledby="transcript" className="transcript">
        <h2 id="transcript">Transcript</h2>
        {run.inputText && <div className="part user"><span className="role">user</span><p>{run.inputText}</p></div>}
        <Parts parts={state.parts} state={state} />
        {state.parts.length === 0 && !terminal && <p className="hint">Waiting for the model…</p>}
      </section>

      {record && <Record record={record} currentRunId={runId} />}
    </article>
  );
}

function RetryIndicator({ retry }: { retry: RetryInfo }) {
  const now = useNow(250);
  const left = Math.max(0, Math.ceil((Date.parse(retry.nextAttemptAt) - now) / 1000));
  return (
    <section className="retry" role="status" aria-label="Retry" data-testid="retry-indicator">
      <strong>Attempt {retry.attempt} of {retry.maxAttempts} failed</strong>
      {retry.error && <span> — {retry.error.message || retry.error.code}{retry.error.providerStatus ? ` (HTTP ${retry.error.providerStatus})` : ""}</span>}
      <span className="countdown" data-testid="retry-countdown">
        {left > 0 ? ` Next attempt (${retry.attempt + 1} of ${retry.maxAttempts}) in ${left} s` : " Next attempt starting…"}
      </span>
    </section>
  );
}

function Parts({ parts, state }: { parts: PartJson[]; state: RunState }) {
  const results = useMemo(() => {
    const m = new Map<string, PartJson>();
    for (const p of parts) if (p.toolResult?.toolCallId) m.set(p.toolResult.toolCallId, p);
    return m;
  }, [parts]);
  return (
    <>
      {parts.map((p) => {
        const key = `${p.index ?? 0}`;
        if (p.text) return <div key={key} className={`part ${p.role ?? ""}`} data-part={p.index ?? 0}><span className="role">{p.role}</span><p>{partText(state, p)}</p></div>;
        if (p.thinking) return (
          <details key={key} className="part thinking" data-part={p.index ?? 0}>
            <summary>Thinking</summary>
            <p>{p.thinking.thinking}</p>
          </details>
        );
        if (p.toolCall) {
          const result = results.get(p.toolCall.toolCallId ?? "");
          return (
            <div key={key} className="part tool" data-part={p.index ?? 0}>
              <span className="role">tool call</span>
              <p><code>{p.toolCall.name}</code></p>
              <pre aria-label={`Input of ${p.toolCall.name ?? "the tool"}`} tabIndex={0}>{JSON.stringify(p.toolCall.input ?? {}, null, 2)}</pre>
              {result?.toolResult && (
                <div className={result.toolResult.isError ? "result error" : "result"}>
                  <span className="role">{result.toolResult.isError ? "error" : "result"}{result.toolResult.truncated ? " (truncated)" : ""}</span>
                  <pre tabIndex={0}>{result.toolResult.content}</pre>
                </div>
              )}
            </div>
          );
        }
        if (p.toolResult) return null; // shown under its call
        if (p.question) return <p key={key} className="part marker">Asked a question</p>;
        if (p.approval) return <p key={key} className="part marker">Asked to approve <code>{p.approval.toolName}</code></p>;
        if (p.connection) return <p key={key} className="part marker">Needed a connection to {p.connection.provider}</p>;
        if (p.timer) return <p key={key} className="part marker">Waited until <time dateTime={p.timer.dueAt}>{p.timer.dueAt}</time></p>;
        if (p.summary) return (
          <details key={key} className="part summary"><summary>Summary of {p.summary.runs ?? 0} earlier runs</summary><p>{p.summary.text}</p></details>
        );
        return null;
      })}
    </>
  );
}

const STAGES = ["routing", "context", "attempt", "finalisation"];

function Record({ record, currentRunId }: { record: GetRunAttemptsResponseJson; currentRunId: string }) {
  const now = Date.now();
  const attempts = record.attempts ?? [];
  const turns = record.turns ?? [];
  const lineage = record.lineage ?? [];
  const stagesOf = (a: (typeof attempts)[number]) =>
    Object.fromEntries(Object.entries(a.stageMs ?? {}).map(([k, v]) => [k, Number(v)])) as Record<string, number>;
  const longest = Math.max(1, ...attempts.map((a) => {
    const st = stagesOf(a);
    return st["total"] ?? STAGES.reduce((sum, k) => sum + (st[k] ?? 0), 0);
  }));
  return (
    <>
      <section aria-labelledby="attempts-title">
        <h2 id="attempts-title">Attempts</h2>
        <p className="legend" aria-hidden="true">
          {STAGES.map((k) => <span key={k}><span className={`swatch stage-${k}`} />{k}</span>)}
        </p>
        <table>
          <thead><tr><th scope="col">#</th><th scope="col">Worker</th><th scope="col">Outcome</th><th scope="col">Started</th><th scope="col">Stages</th></tr></thead>
          <tbody>
            {attempts.map((a) => (
              <tr key={`${a.attempt}-${a.leaseEpoch}`}>
                <td>{a.attempt}</td>
                <td><code>{a.workerId}</code></td>
                <td>{a.outcome || "running"}{a.error ? `: ${a.error.code}` : ""}</td>
                <td>{age(a.startedAt, now)} ago</td>
                <td><Timeline stages={stagesOf(a)} longest={longest} /></td>
              </tr>
            ))}
          </tbody>
        </table>
      </section>
      <section aria-labelledby="turns-title">
        <h2 id="turns-title">Model turns</h2>
        <table>
          <thead><tr><th scope="col">Attempt</th><th scope="col">Model</th><th scope="col" className="num">Input</th><th scope="col" className="num">Output</th><th scope="col" className="num">Cache read</th><th scope="col" className="num">Cache write</th><th scope="col" className="num">Cost</th></tr></thead>
          <tbody>
            {turns.map((t, i) => (
              <tr key={i}>
                <td>{t.attempt}</td>
                <td>{t.usage?.model}</td>
                <td className="num">{tokens(t.usage?.inputTokens)}</td>
                <td className="num">{tokens(t.usage?.outputTokens)}</td>
                <td className="num">{tokens(t.usage?.cacheReadInputTokens)}</td>
                <td className="num">{tokens(t.usage?.cacheCreationInputTokens)}</td>
                <td className="num">{formatMicros(t.usage?.costMicros)}</td>
              </tr>
            ))}
            {turns.length === 0 && <tr><td colSpan={7} className="empty">No priced turns yet.</td></tr>}
          </tbody>
        </table>
      </section>
      {lineage.length > 1 && (
        <section aria-labelledby="lineage-title">
          <h2 id="lineage-title">Lineage</h2>
          <ol className="lineage">
            {lineage.map((r) => (
              <li key={r.runId}>
                {r.runId === currentRunId ? <strong><code>{r.runId}</code> (this run)</strong> : <a href={href({ page: "run", runId: r.runId ?? "" })} onClick={onLinkClick}><code>{r.runId}</code></a>}
                {" "}<span className={statusClass(r.status)}>{statusWords(r.status)}</span>
              </li>
            ))}
          </ol>
        </section>
      )}
    </>
  );
}

function Timeline({ stages, longest }: { stages: Record<string, number>; longest: number }) {
  const known = STAGES.filter((k) => stages[k] !== undefined);
  const label = known.map((k) => `${k} ${ms(stages[k])}`).join(", ") + (stages["total"] !== undefined ? `; total ${ms(stages["total"])}` : "");
  return (
    <div className="timeline" role="img" aria-label={label || "no stage durations"} title={label}>
      {known.map((k) => (
        // Widths through the CSSOM (React style props), which the console's CSP allows.
        <span key={k} className={`stage stage-${k}`} style={{ width: `${Math.max(0.5, ((stages[k] ?? 0) / longest) * 100)}%` }} />
      ))}
      <span className="timeline-text">{label}</span>
    </div>
  );
}
