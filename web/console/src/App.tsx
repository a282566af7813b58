import { useEffect, useState, type FormEvent } from "react";
import { useSession } from "@tether/react";
import { AgentPage } from "./AgentPage.js";
import { AgentsPage } from "./AgentsPage.js";
import { ChannelPage } from "./ChannelPage.js";
import { ChannelsPage } from "./ChannelsPage.js";
import { ConnectedPage } from "./ConnectedPage.js";
import { RunPage } from "./RunPage.js";
import { RunsPage } from "./RunsPage.js";
import { SchedulesPage } from "./SchedulesPage.js";
import { BASE, onLinkClick, useRoute } from "./router.js";

export function useNow(everyMs = 1000): number {
  const [now, setNow] = useState(() => Date.now());
  useEffect(() => {
    const t = setInterval(() => setNow(Date.now()), everyMs);
    return () => clearInterval(t);
  }, [everyMs]);
  return now;
}

export function App() {
  const { session, loading, error, signIn, signOut } = useSession();
  const route = useRoute();
  if (loading) return <main className="page"><p role="status">Loading…</p></main>;
  if (!session) return <SignIn onSignIn={signIn} error={error?.message} />;
  return (
    <>
      <header className="bar">
        <a href={`${BASE}/`} onClick={onLinkClick} className="brand">Tether</a>
        <nav aria-label="Pages" className="pages">
          <a href={`${BASE}/`} onClick={onLinkClick} aria-current={route.page === "runs" || route.page === "run" ? "page" : undefined}>Runs</a>
          <a href={`${BASE}/agents`} onClick={onLinkClick} aria-current={route.page === "agents" || route.page === "agent" ? "page" : undefined}>Agents</a>
          <a href={`${BASE}/channels`} onClick={onLinkClick} aria-current={route.page === "channels" || route.page === "channel" ? "page" : undefined}>Channels</a>
          <a href={`${BASE}/schedules`} onClick={onLinkClick} aria-current={route.page === "schedules" ? "page" : undefined}>Schedules</a>
        </nav>
        <span className="who" aria-label="Signed in as">
          {session.principal} · {session.tenantId}
        </span>
        <button type="button" className="quiet" onClick={() => void signOut()}>Sign out</button>
      </header>
      <main className="page">
        {route.page === "runs" && <RunsPage />}
        {route.page === "run" && <RunPage key={route.runId} runId={route.runId} />}
        {route.page === "connected" && <ConnectedPage />}
        {route.page === "agents" && <AgentsPage />}
        {route.page === "agent" && <AgentPage key={route.name} name={route.name} />}
        {route.page === "channels" && <ChannelsPage />}
        {route.page === "channel" && <ChannelPage key={route.channelId} channelId={route.channelId} />}
        {route.page === "schedules" && <SchedulesPage />}
        {route.page === "missing" && <NotFound what="page" />}
      </main>
    </>
  );
}

/** A stream or call answered 401: the session was revoked or expired (or signed out elsewhere). */
export function SessionEnded() {
  return (
    <section className="card" role="alert" aria-label="Session ended">
      <p>Your session has ended (signed out, expired or revoked).</p>
      <button type="button" onClick={() => window.location.reload()}>Sign in again</button>
    </section>
  );
}

export function NotFound({ what }: { what: string }) {
  return (
    <section className="not-found" aria-labelledby="nf">
      <h1 id="nf">Not found</h1>
      <p>There is no {what} here, or you may not see it.</p>
      <p><a href={`${BASE}/`} onClick={onLinkClick}>Back to runs</a></p>
    </section>
  );
}

function SignIn({ onSignIn, error }: { onSignIn: (key: string) => Promise<boolean>; error: string | undefined }) {
  const [key, setKey] = useState("");
  const [busy, setBusy] = useState(false);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (!key.trim() || busy) return;
    setBusy(true);
    const ok = await onSignIn(key.trim());
    // The key is exchanged for an HttpOnly session cookie and forgotten either way.
    setKey("");
    if (!ok) setBusy(false);
  };
  return (
    <main className="page sign-in">
      <h1>Tether console</h1>
      <form onSubmit={submit} className="card" aria-label="Sign in">
        <label htmlFor="api-key">API key</label>
        <input id="api-key" name="api-key" type="password" autoComplete="off" spellCheck={false} value={key} onChange={(e) => setKey(e.target.value)} required />
        <button type="submit" disabled={busy}>Sign in</button>
        {error && <p className="tether-error" role="alert">{error}</p>}
        <p className="hint">The key is exchanged for a session cookie; the page does not keep it.</p>
      </form>
    </main>
  );
}
