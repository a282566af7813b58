import { useCallback, useEffect, useState } from "react";
import type { AddChannelResponseJson, ChannelInfoJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { SessionEnded, useNow } from "./App.js";
import { AddChannelForm } from "./AddChannelForm.js";
import { CopyButton } from "./CopyButton.js";
import { asTetherError } from "./agents.js";
import { previousSecret, secretHints } from "./channels.js";
import { href, onLinkClick } from "./router.js";

type Row = ChannelInfoJson & { webhookUrl?: string };

/** The tenant's channel connections: kind, agent, webhook URL, secrets as name and last four. */
export function ChannelsPage() {
  const client = useTetherClient();
  const now = useNow(10_000);
  const [rows, setRows] = useState<Row[] | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const [added, setAdded] = useState<AddChannelResponseJson | null>(null);
  const load = useCallback(async () => {
    try {
      const listed = (await client.listChannels()).channels ?? [];
      setRows(listed);
      setError(null);
      // The list carries no webhook URL; each connection is read for its own.
      const shown = await Promise.all(listed.map((c) => client.getChannel(c.channelId ?? "")));
      setRows(listed.map((c, i) => ({ ...c, webhookUrl: shown[i]?.webhookUrl ?? "" })));
    } catch (exc) {
      setError(asTetherError(exc));
    }
  }, [client]);
  useEffect(() => {
    void load();
  }, [load]);
  return (
    <section aria-labelledby="channels-title">
      <div className="title-row">
        <h1 id="channels-title">Channels</h1>
      </div>
      {error?.status === "UNAUTHENTICATED" && <SessionEnded />}
      {error && error.status !== "UNAUTHENTICATED" && <p className="tether-error" role="alert">{error.message}</p>}
      <table className="channels">
        <thead>
          <tr>
            <th scope="col">Name</th><th scope="col">Kind</th><th scope="col">Agent</th><th scope="col">Webhook URL</th>
            <th scope="col">Secrets</th><th scope="col">Previous secret</th>
          </tr>
        </thead>
        <tbody>
          {(rows ?? []).map((c) => (
            <tr key={c.channelId} data-channel={c.channelId}>
              <td><a href={href({ page: "channel", channelId: c.channelId ?? "" })} onClick={onLinkClick}>{c.name}</a></td>
              <td>{c.kind}</td>
              <td>{c.agent || "routes"}</td>
              <td className="url">
                {c.webhookUrl === undefined ? "…" : <><code>{c.webhookUrl}</code> <CopyButton text={c.webhookUrl} label={`Copy the webhook URL of ${c.name}`} /></>}
              </td>
              <td className="secrets">{secretHints(c).join(", ")}</td>
              <td>{previousSecret(c, now)}</td>
            </tr>
          ))}
          {rows?.length === 0 && <tr><td colSpan={6} className="empty">No channels yet.</td></tr>}
        </tbody>
      </table>
      <h2 id="new-channel">New channel</h2>
      {added && (
        <div className="card" role="status" aria-label="Channel added">
          <p>Channel {added.channel?.name} added ({added.channelId}). Give the provider this URL:</p>
          <p><code>{added.webhookUrl}</code> <CopyButton text={added.webhookUrl ?? ""} label="Copy the new webhook URL" /></p>
        </div>
      )}
      <AddChannelForm onAdded={(out) => { setAdded(out); void load(); }} />
    </section>
  );
}
