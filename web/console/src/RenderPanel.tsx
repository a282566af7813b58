import { useState, type FormEvent } from "react";
import type { RenderAgentResponseJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { asTetherError } from "./agents.js";
import { formatMicros, tokens } from "./format.js";

/**
 * The exact request a worker would send first for a sample message in a new conversation, built
 * by a worker with no model call and no run, and which agent the tenant's routes pick for the
 * source and channel.
 */
export function RenderPanel({ name }: { name: string }) {
  const client = useTetherClient();
  const [message, setMessage] = useState("");
  const [source, setSource] = useState("");
  const [channel, setChannel] = useState("");
  const [busy, setBusy] = useState(false);
  const [rendered, setRendered] = useState<RenderAgentResponseJson | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (busy || !message.trim()) return;
    setBusy(true);
    setError(null);
    try {
      setRendered(await client.renderAgent(name, { message, source: source.trim(), channel: channel.trim() }));
    } catch (exc) {
      setRendered(null);
      setError(asTetherError(exc));
    } finally {
      setBusy(false);
    }
  };
  return (
    <form className="card render" onSubmit={submit} aria-label="Render">
      <label htmlFor="render-message">Message</label>
      <textarea id="render-message" rows={3} value={message} onChange={(e) => setMessage(e.target.value)} required />
      <div className="filters">
        <label>Source<input value={source} onChange={(e) => setSource(e.target.value)} placeholder="any" /></label>
        <label>Channel<input value={channel} onChange={(e) => setChannel(e.target.value)} placeholder="any" /></label>
      </div>
      <div className="actions"><button type="submit" disabled={busy}>Render</button></div>
      {error && <p className="tether-error" role="alert">{error.status}: {error.message}</p>}
      {rendered && (
        <div role="region" aria-label="Rendered request">
          <dl className="facts">
            <dt>Rendered</dt><dd data-testid="rendered-agent">{rendered.agent} version {rendered.version ?? 0}</dd>
            <dt>The routes pick</dt>
            <dd data-testid="routed-agent">{rendered.routedAgent ? `${rendered.routedAgent} version ${rendered.routedVersion ?? 0}` : "no agent"}</dd>
            <dt>Input tokens (estimate)</dt><dd>{tokens(rendered.estimatedInputTokens)}</dd>
            <dt>Cost (estimate)</dt><dd>{formatMicros(rendered.estimatedCostMicros)}</dd>
          </dl>
          <pre aria-label="Request" data-testid="rendered-request">{pretty(rendered.requestJson)}</pre>
        </div>
      )}
    </form>
  );
}

function pretty(requestJson: string | undefined): string {
  try {
    return JSON.stringify(JSON.parse(requestJson ?? "{}"), null, 2);
  } catch {
    return requestJson ?? "";
  }
}
