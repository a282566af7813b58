import { useState } from "react";
import type { RunStatusJson } from "@tether/client";
import { useRuns } from "@tether/react";
import { SessionEnded, useNow } from "./App.js";
import { STATUSES, age, formatMicros, statusClass, statusWords } from "./format.js";
import { href, onLinkClick } from "./router.js";

export function RunsPage() {
  const [status, setStatus] = useState<RunStatusJson | "">("");
  const [conversation, setConversation] = useState("");
  const [applied, setApplied] = useState("");
  const { runs, error, live } = useRuns({ statuses: status ? [status] : [], ...(applied ? { conversationId: applied } : {}) });
  const now = useNow(1000);
  return (
    <section aria-labelledby="runs-title">
      <div className="title-row">
        <h1 id="runs-title">Runs</h1>
        <span className={live ? "live on" : "live"} role="status">{live ? "live" : "connecting…"}</span>
      </div>
      <form className="filters" onSubmit={(e) => { e.preventDefault(); setApplied(conversation.trim()); }} aria-label="Filters">
        <label>
          Status
          <select value={status} onChange={(e) => setStatus(e.target.value as RunStatusJson | "")}>
            <option value="">all</option>
            {STATUSES.map((s) => <option key={s} value={s}>{statusWords(s)}</option>)}
          </select>
        </label>
        <label>
          Conversation
          <input type="search" value={conversation} onChange={(e) => setConversation(e.target.value)} onBlur={() => setApplied(conversation.trim())} placeholder="any" />
        </label>
        <button type="submit">Filter</button>
      </form>
      {error?.status === "UNAUTHENTICATED" && <SessionEnded />}
      {error && error.status !== "UNAUTHENTICATED" && <p className="tether-error" role="alert">{error.message}</p>}
      <table className="runs">
        <thead>
          <tr><th scope="col">Run</th><th scope="col">Status</th><th scope="col">Conversation</th><th scope="col">Model</th><th scope="col" className="num">Cost</th><th scope="col" className="num">Age</th></tr>
        </thead>
        <tbody>
          {runs.map((run) => (
            <tr key={run.runId} data-run-id={run.runId}>
              <td><a href={href({ page: "run", runId: run.runId ?? "" })} onClick={onLinkClick}>{run.runId}</a></td>
              <td><span className={statusClass(run.status)}>{statusWords(run.status)}</span></td>
              <td className="conv">{run.conversationId}</td>
              <td>{run.routing?.model || run.usage?.model || "—"}</td>
              <td className="num">{formatMicros(run.usage?.costMicros)}</td>
              <td className="num"><time dateTime={run.createdAt}>{age(run.createdAt, now)}</time></td>
            </tr>
          ))}
          {runs.length === 0 && live && (
            <tr><td colSpan={6} className="empty">No runs{status || applied ? " match these filters" : " yet"}.</td></tr>
          )}
        </tbody>
      </table>
    </section>
  );
}
