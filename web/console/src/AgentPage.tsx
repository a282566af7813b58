import { useCallback, useEffect, useMemo, useState } from "react";
import type { AgentVersionJson, GetAgentResponseJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { NotFound, SessionEnded } from "./App.js";
import { ApplyForm, Refusal } from "./ApplyForm.js";
import { RenderPanel } from "./RenderPanel.js";
import { asTetherError, routesOf } from "./agents.js";
import { changed, documentLines, lineDiff } from "./diff.js";
import { BASE, onLinkClick } from "./router.js";

/** One agent: its versions, a diff between two, an edit applied on a base version, rollback, render. */
export function AgentPage({ name }: { name: string }) {
  const client = useTetherClient();
  const [agent, setAgent] = useState<GetAgentResponseJson | null>(null);
  const [versions, setVersions] = useState<AgentVersionJson[]>([]);
  const [error, setError] = useState<TetherError | null>(null);
  // The version the editor's text was loaded from: the base of a conditional apply. It moves only
  // when the person loads the published version, never behind their back.
  const [edited, setEdited] = useState<{ base: number; text: string; loaded: number } | null>(null);
  const [rolled, setRolled] = useState("");
  const [rollbackError, setRollbackError] = useState<{ refused: TetherError; base: number } | null>(null);

  const load = useCallback(async (resetEditor: boolean) => {
    try {
      const [got, listed] = await Promise.all([client.getAgent(name), client.listAgentVersions(name)]);
      setAgent(got);
      setVersions(listed.versions ?? []);
      setError(null);
      if (resetEditor) setEdited((e) => ({ base: got.publishedVersion ?? 0, text: got.agent?.spec ?? "", loaded: (e?.loaded ?? 0) + 1 }));
    } catch (exc) {
      setError(asTetherError(exc));
    }
  }, [client, name]);
  useEffect(() => {
    void load(true);
  }, [load]);

  // The base is the version this page shows as published: a rollback decided on a view another
  // apply has since made stale is refused (409) rather than undoing a change nobody here saw.
  const rollback = async (to: number, base: number) => {
    setRolled("");
    setRollbackError(null);
    try {
      const out = await client.rollbackAgent(name, to, base);
      setRolled(`Version ${out.version} is published again; runs routed from now on get it.`);
      await load(true);
    } catch (exc) {
      setRollbackError({ refused: asTetherError(exc), base });
    }
  };
  const reloadAfterConflict = () => {
    setRollbackError(null);
    void load(false);
  };

  if (error?.status === "NOT_FOUND") return <NotFound what="agent" />;
  const published = agent?.publishedVersion ?? 0;
  return (
    <section aria-labelledby="agent-title">
      <p><a href={`${BASE}/agents`} onClick={onLinkClick}>All agents</a></p>
      <div className="title-row">
        <h1 id="agent-title">Agent {name}</h1>
        {agent?.default && <span className="status">default</span>}
      </div>
      {error?.status === "UNAUTHENTICATED" && <SessionEnded />}
      {error && error.status !== "UNAUTHENTICATED" && <p className="tether-error" role="alert">{error.message}</p>}
      {agent && (
        <dl className="facts">
          <dt>Published version</dt><dd data-testid="published-version">{published}</dd>
          <dt>Routes</dt><dd>{routesOf(agent.agent?.normalised).join("; ") || "none"}</dd>
        </dl>
      )}

      <h2 id="versions-title">Versions</h2>
      <table className="versions" aria-labelledby="versions-title">
        <thead>
          <tr><th scope="col" className="num">Version</th><th scope="col">Applied</th><th scope="col">Digest</th><th scope="col">Published</th><th scope="col"><span className="timeline-text">Actions</span></th></tr>
        </thead>
        <tbody>
          {versions.map((v) => (
            <tr key={v.version} data-version={v.version}>
              <td className="num">{v.version}</td>
              <td><time dateTime={v.createdAt}>{v.createdAt ? new Date(v.createdAt).toLocaleString() : ""}</time></td>
              <td><code>{(v.digest ?? "").slice(0, 12)}</code></td>
              <td>{v.version === published ? "published" : ""}</td>
              <td>
                {v.version !== published && (
                  <button type="button" className="quiet" onClick={() => void rollback(v.version ?? 0, published)}>
                    Roll back to version {v.version}
                  </button>
                )}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      {rolled && <p role="status">{rolled}</p>}
      {rollbackError && (
        <Refusal refused={rollbackError.refused} base={rollbackError.base} change="rolled back" onReload={reloadAfterConflict} />
      )}

      {versions.length > 0 && <VersionDiff versions={versions} published={published} />}

      <h2 id="edit-title">Edit</h2>
      {edited && (
        <ApplyForm
          label="Edit agent"
          initial={edited.text}
          base={edited.base}
          loaded={edited.loaded}
          onApplied={() => void load(true)}
          onReload={() => void load(true)}
        />
      )}

      <h2 id="render-title">Render a sample message</h2>
      <RenderPanel name={name} />
    </section>
  );
}

function VersionDiff({ versions, published }: { versions: AgentVersionJson[]; published: number }) {
  const numbers = versions.map((v) => v.version ?? 0);
  // Until the person picks, the diff is the published version against the one before it.
  const [picked, setPicked] = useState<{ from?: number; to?: number }>({});
  const to = picked.to ?? (published || numbers[numbers.length - 1]!);
  const from = picked.from ?? numbers[Math.max(0, numbers.indexOf(to) - 1)]!;
  const diff = useMemo(() => {
    const doc = (n: number) => versions.find((v) => v.version === n)?.normalised ?? "{}";
    return lineDiff(documentLines(doc(from)), documentLines(doc(to)));
  }, [versions, from, to]);
  return (
    <div className="version-diff">
      <h2 id="diff-title">Diff</h2>
      <form className="filters" aria-label="Versions to compare" onSubmit={(e) => e.preventDefault()}>
        <label>
          From version
          <select aria-label="From version" value={from} onChange={(e) => setPicked({ from: Number(e.target.value), to })}>
            {numbers.map((n) => <option key={n} value={n}>{n}</option>)}
          </select>
        </label>
        <label>
          To version
          <select aria-label="To version" value={to} onChange={(e) => setPicked({ from, to: Number(e.target.value) })}>
            {numbers.map((n) => <option key={n} value={n}>{n}</option>)}
          </select>
        </label>
      </form>
      {changed(diff) ? (
        <pre className="diff" aria-label={`Diff from version ${from} to ${to}`}>
          {diff.map((line, i) => (
            <span key={i} className={`diff-${line.kind}`}>
              {line.kind === "added" ? "+ " : line.kind === "removed" ? "- " : "  "}
              {line.text}
              {"\n"}
            </span>
          ))}
        </pre>
      ) : (
        <p className="hint" role="status">Versions {from} and {to} have the same document.</p>
      )}
    </div>
  );
}
