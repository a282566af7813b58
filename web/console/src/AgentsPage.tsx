import { useCallback, useEffect, useState } from "react";
import type { AgentSummaryJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { SessionEnded } from "./App.js";
import { ApplyForm } from "./ApplyForm.js";
import { asTetherError, routesOf } from "./agents.js";
import { href, navigate, onLinkClick } from "./router.js";

type Row = AgentSummaryJson & { routes?: string[] };

const NEW_AGENT = "name: helper\ninstructions: You are Helper, brief and exact.\nroutes:\n  - channel: web\n";

/** The tenant's agents: name, published version, default, routes; and a form for a new one. */
export function AgentsPage() {
  const client = useTetherClient();
  const [rows, setRows] = useState<Row[] | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const load = useCallback(async () => {
    try {
      const listed = (await client.listAgents()).agents ?? [];
      setRows(listed);
      setError(null);
      // The list carries no document; each published one is read for its routes.
      const published = await Promise.all(listed.map((a) => client.getAgent(a.name ?? "")));
      setRows(listed.map((a, i) => ({ ...a, routes: routesOf(published[i]?.agent?.normalised) })));
    } catch (exc) {
      setError(asTetherError(exc));
    }
  }, [client]);
  useEffect(() => {
    void load();
  }, [load]);
  return (
    <section aria-labelledby="agents-title">
      <div className="title-row">
        <h1 id="agents-title">Agents</h1>
      </div>
      {error?.status === "UNAUTHENTICATED" && <SessionEnded />}
      {error && error.status !== "UNAUTHENTICATED" && <p className="tether-error" role="alert">{error.message}</p>}
      <table className="agents">
        <thead>
          <tr><th scope="col">Agent</th><th scope="col" className="num">Published</th><th scope="col">Default</th><th scope="col">Routes</th></tr>
        </thead>
        <tbody>
          {(rows ?? []).map((agent) => (
            <tr key={agent.name} data-agent={agent.name}>
              <td><a href={href({ page: "agent", name: agent.name ?? "" })} onClick={onLinkClick}>{agent.name}</a></td>
              <td className="num">{agent.publishedVersion ?? 0}</td>
              <td>{agent.default ? "default" : ""}</td>
              <td className="routes">{agent.routes === undefined ? "…" : agent.routes.join("; ") || (agent.default ? "none: takes the unrouted runs" : "none")}</td>
            </tr>
          ))}
          {rows?.length === 0 && <tr><td colSpan={4} className="empty">No agents yet.</td></tr>}
        </tbody>
      </table>
      <h2 id="new-agent">New agent</h2>
      <ApplyForm
        label="New agent"
        initial={NEW_AGENT}
        base={undefined}
        onApplied={(out) => navigate(href({ page: "agent", name: out.name ?? "" }))}
      />
    </section>
  );
}
