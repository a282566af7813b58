import { useEffect, useState } from "react";
import { CONNECT_STORAGE_PREFIX, useTetherClient } from "@tether/react";
import { href, onLinkClick } from "./router.js";

/**
 * Where the OAuth round trip of a connection card ends: completes the consent for the run the
 * card was for (found by the OAuth state) and links back to it. The code leaves the address bar
 * at once.
 */
export function ConnectedPage() {
  const client = useTetherClient();
  const [params] = useState(() => new URLSearchParams(window.location.search));
  const [message, setMessage] = useState("Completing the connection…");
  const [runId, setRunId] = useState<string | null>(null);
  useEffect(() => {
    window.history.replaceState(null, "", window.location.pathname);
    const state = params.get("state") ?? "";
    const code = params.get("code") ?? "";
    const denied = params.get("error");
    if (denied) {
      setMessage(`The provider did not connect: ${denied}.`);
      return;
    }
    let id: string | null = null;
    try {
      id = window.sessionStorage.getItem(CONNECT_STORAGE_PREFIX + state);
    } catch {
      id = null;
    }
    if (!state || !id) {
      setMessage("This page does not know which run the connection was for; open the run and use its Sign in button.");
      return;
    }
    setRunId(id);
    let live = true;
    client.completeConnection(id, { state, code }).then(
      (out) => {
        if (!live) return;
        window.sessionStorage.removeItem(CONNECT_STORAGE_PREFIX + state);
        setMessage(out.resumed ? "Connected; the run resumes." : "Connected already; nothing more to do.");
      },
      (exc: unknown) => live && setMessage(exc instanceof Error ? exc.message : String(exc)),
    );
    return () => {
      live = false;
    };
  }, [client, params]);
  return (
    <section aria-labelledby="connected-title">
      <h1 id="connected-title">Connection</h1>
      <p role="status">{message}</p>
      {runId && <p><a href={href({ page: "run", runId })} onClick={onLinkClick}>Back to the run</a></p>}
    </section>
  );
}
