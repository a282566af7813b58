import { useState, type FormEvent } from "react";
import { agentPath, type TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { asTetherError } from "./agents.js";

/** RenderAgent's answer in protobuf's JSON mapping (issue 29 item 5), read loosely: shown as given. */
type Rendered = { agent?: string; version?: number; estimatedInputTokens?: string | number; estimatedCostUsd?: string | number } & Record<string, unknown>;

/**
 * The exact request a worker would send for a sample message in a new conversation, with no model
 * call and no run: `POST /v2/agents/{name}/render`.
 */
export function RenderPanel({ name }: { name: string }) {
  const client = useTetherClient();
  const [message, setMessage] = useState("");
  const [source, setSource] = useState("");
  const [channel, setChannel] = useState("");
  const [busy, setBusy] = useState(false);
  const [rendered, setRendered] = useState<Rendered | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (busy || !message.trim()) return;
    setBusy(true);
    setError(null);
    try {
      setRendered(await client.call<Rendered>("POST", `${agentPath(name)}/render`, { message, source, channel }));
    } catch (exc) {
      setRendered(null);
      setError(asTetherError(exc));
    } finally {
      setBusy(false);
    }
  };
  const { agent, version, estimatedInputTokens, estimatedCostUsd, ...request } = rendered ?? {};
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
            <dt>Routed to</dt><dd>{agent} version {version}</dd>
            <dt>Input tokens (estimate)</dt><dd>{String(estimatedInputTokens ?? "")}</dd>
            <dt>Cost (estimate, USD)</dt><dd>{String(estimatedCostUsd ?? "")}</dd>
          </dl>
          <pre>{JSON.stringify(request, null, 2)}</pre>
        </div>
      )}
    </form>
  );
}
