import { useEffect, useState, type FormEvent } from "react";
import type { ApplyAgentResponseJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { applyRefusal, asTetherError } from "./agents.js";

/**
 * A document to apply (JSON or YAML text). With `base`, the apply is conditional: if another
 * version was published since, the server refuses it (409 ABORTED) and the page says so, keeping
 * the text for the person to redo the change on the published version (`onReload`).
 */
export function ApplyForm({
  label,
  initial,
  base,
  loaded = 0,
  onApplied,
  onReload,
}: {
  label: string;
  initial: string;
  base: number | undefined;
  /** Counts the loads of `initial`: each puts the text back, even when it is the same. */
  loaded?: number;
  onApplied: (out: ApplyAgentResponseJson) => void;
  onReload?: () => void;
}) {
  const client = useTetherClient();
  const [text, setText] = useState(initial);
  const [busy, setBusy] = useState(false);
  const [refused, setRefused] = useState<TetherError | null>(null);
  const [done, setDone] = useState("");
  useEffect(() => {
    setText(initial);
    setRefused(null);
  }, [initial, base, loaded]);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (busy) return;
    setBusy(true);
    setRefused(null);
    setDone("");
    try {
      const out = await client.applyAgent(base === undefined ? { spec: text } : { spec: text, baseVersion: base });
      setDone(out.created ? `Created and published version ${out.version}.` : `Identical to the published version ${out.version}: nothing was created.`);
      onApplied(out);
    } catch (exc) {
      setRefused(asTetherError(exc));
    } finally {
      setBusy(false);
    }
  };
  return (
    <form className="card apply" onSubmit={submit} aria-label={label}>
      <label htmlFor={`${label}-doc`}>Document (JSON or YAML)</label>
      <textarea id={`${label}-doc`} rows={14} spellCheck={false} value={text} onChange={(e) => setText(e.target.value)} />
      <div className="actions">
        <button type="submit" disabled={busy}>Apply</button>
        {base !== undefined && <span className="hint" data-testid="base-version">Applies only while version {base} is published.</span>}
      </div>
      {done && <p role="status">{done}</p>}
      {refused && <Refusal refused={refused} base={base} change="applied" onReload={onReload} />}
    </form>
  );
}

/** A refused apply or rollback: a conflict offers to load the published version. */
export function Refusal({
  refused,
  base,
  change,
  onReload,
}: {
  refused: TetherError;
  base: number | undefined;
  change: "applied" | "rolled back";
  onReload?: (() => void) | undefined;
}) {
  const said = applyRefusal(refused, base, change);
  return (
    <div className={refused.status === "ABORTED" ? "conflict" : "refusal"} role="alert">
      <p><strong>{said.title}</strong></p>
      <pre>{said.detail}</pre>
      {refused.status === "ABORTED" && onReload && (
        <button type="button" className="quiet" onClick={onReload}>Load the published version</button>
      )}
    </div>
  );
}
