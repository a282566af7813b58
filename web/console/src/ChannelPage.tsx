import { useCallback, useEffect, useState, type FormEvent } from "react";
import type { GetChannelResponseJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { NotFound, SessionEnded, useNow } from "./App.js";
import { CopyButton } from "./CopyButton.js";
import { asTetherError } from "./agents.js";
import { parseGrace, previousSecret, secretHints, target } from "./channels.js";
import { BASE, href, navigate, onLinkClick } from "./router.js";

/** One connection: what it is (never its secrets), its webhook URL, a rotation, its removal. */
export function ChannelPage({ channelId }: { channelId: string }) {
  const client = useTetherClient();
  const now = useNow(10_000);
  const [shown, setShown] = useState<GetChannelResponseJson | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const load = useCallback(async () => {
    try {
      setShown(await client.getChannel(channelId));
      setError(null);
    } catch (exc) {
      setError(asTetherError(exc));
    }
  }, [client, channelId]);
  useEffect(() => {
    void load();
  }, [load]);
  if (error?.status === "NOT_FOUND") return <NotFound what="channel" />;
  const channel = shown?.channel;
  const settings = Object.entries(channel?.settings ?? {});
  return (
    <section aria-labelledby="channel-title">
      <p><a href={`${BASE}/channels`} onClick={onLinkClick}>All channels</a></p>
      <div className="title-row">
        <h1 id="channel-title">Channel {channel?.name ?? channelId}</h1>
        {channel && <span className="status">{channel.kind}</span>}
      </div>
      {error?.status === "UNAUTHENTICATED" && <SessionEnded />}
      {error && error.status !== "UNAUTHENTICATED" && <p className="tether-error" role="alert">{error.message}</p>}
      {channel && shown && (
        <dl className="facts">
          <dt>Id</dt><dd><code>{channel.channelId}</code></dd>
          <dt>Agent</dt><dd>{channel.agent || `the tenant's routes (source messaging, channel ${channel.kind})`}</dd>
          <dt>Webhook URL</dt>
          <dd><code data-testid="webhook-url">{shown.webhookUrl}</code> <CopyButton text={shown.webhookUrl ?? ""} label="Copy the webhook URL" /></dd>
          <dt>{channel.replyUrl ? "Reply URL" : "API base URL"}</dt><dd><code>{target(channel) || "none"}</code></dd>
          {settings.map(([k, v]) => <SettingFact key={k} name={k} value={v} />)}
          <dt>Secrets</dt><dd data-testid="secrets">{secretHints(channel).join(", ")}</dd>
          <dt>Previous secret</dt><dd data-testid="previous-secret">{previousSecret(channel, now)}</dd>
          <dt>Added</dt>
          <dd>{channel.createdAt ? new Date(channel.createdAt).toLocaleString() : ""} by {channel.createdBy}</dd>
        </dl>
      )}
      {channel && <RotateForm channelId={channelId} onRotated={(c) => setShown((s) => (s && c ? { ...s, channel: c } : s))} />}
      {channel && <RemoveChannel channelId={channelId} name={channel.name ?? channelId} />}
    </section>
  );
}

function SettingFact({ name, value }: { name: string; value: string }) {
  return <><dt>{name}</dt><dd><code>{value}</code></dd></>;
}

function RotateForm({ channelId, onRotated }: { channelId: string; onRotated: (c: GetChannelResponseJson["channel"]) => void }) {
  const client = useTetherClient();
  const [secret, setSecret] = useState("");
  const [grace, setGrace] = useState("24h");
  const [busy, setBusy] = useState(false);
  const [said, setSaid] = useState("");
  const [refused, setRefused] = useState("");
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (busy) return;
    setSaid("");
    setRefused("");
    const seconds = parseGrace(grace);
    if (seconds === null) {
      setRefused(`${JSON.stringify(grace)} is not a duration such as 30m, 24h or 7d.`);
      return;
    }
    setBusy(true);
    try {
      const out = await client.rotateChannelSecret(channelId, secret, seconds);
      setSecret("");
      onRotated(out.channel);
      setSaid("Rotated: the new secret verifies now; the previous one until its grace ends.");
    } catch (exc) {
      setRefused(asTetherError(exc).message);
    } finally {
      setBusy(false);
    }
  };
  return (
    <>
      <h2 id="rotate-title">Rotate the verification secret</h2>
      <form className="card stacked" aria-labelledby="rotate-title" onSubmit={submit}>
        <label>
          New secret
          <input type="password" name="secret" autoComplete="new-password" spellCheck={false} required value={secret} onChange={(e) => setSecret(e.target.value)} />
        </label>
        <label>
          Grace
          <input name="grace" value={grace} onChange={(e) => setGrace(e.target.value)} spellCheck={false} aria-describedby="grace-hint" />
          <span id="grace-hint" className="hint">how long the previous secret still verifies: 30m, 24h, 7d (at most 7 days)</span>
        </label>
        <div className="actions"><button type="submit" disabled={busy}>Rotate</button></div>
        {said && <p role="status">{said}</p>}
        {refused && <p className="tether-error" role="alert">{refused}</p>}
      </form>
    </>
  );
}

function RemoveChannel({ channelId, name }: { channelId: string; name: string }) {
  const client = useTetherClient();
  const [asking, setAsking] = useState(false);
  const [refused, setRefused] = useState("");
  const remove = async () => {
    setRefused("");
    try {
      await client.removeChannel(channelId);
      navigate(href({ page: "channels" }));
    } catch (exc) {
      setRefused(asTetherError(exc).message);
    }
  };
  return (
    <>
      <h2 id="remove-title">Remove</h2>
      {!asking ? (
        <button type="button" className="quiet" onClick={() => setAsking(true)}>Remove channel</button>
      ) : (
        <div className="refusal" role="group" aria-label="Confirm removal">
          <p>Remove channel {name}? Its provider's webhooks are refused from then on.</p>
          <div className="actions">
            <button type="button" className="tether-deny" onClick={() => void remove()}>Remove {name}</button>
            <button type="button" className="quiet" onClick={() => setAsking(false)}>Keep it</button>
          </div>
        </div>
      )}
      {refused && <p className="tether-error" role="alert">{refused}</p>}
    </>
  );
}
