import { useState, type FormEvent } from "react";
import type { AddChannelResponseJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { asTetherError } from "./agents.js";
import { FIELDS, KINDS, addRequest, type Kind } from "./channels.js";

/**
 * A new connection of a kind, with the CLI's fields for it. Secrets are password inputs, sent once
 * and cleared once stored: the API never shows them back, and neither does the page.
 */
export function AddChannelForm({ onAdded }: { onAdded: (out: AddChannelResponseJson) => void }) {
  const client = useTetherClient();
  const [kind, setKind] = useState<Kind>("slack");
  const [name, setName] = useState("");
  const [agent, setAgent] = useState("");
  const [values, setValues] = useState<Record<string, string>>({});
  const [busy, setBusy] = useState(false);
  const [refused, setRefused] = useState<TetherError | null>(null);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (busy) return;
    setBusy(true);
    setRefused(null);
    try {
      const out = await client.addChannel(addRequest(kind, name, agent, values));
      setName("");
      setAgent("");
      setValues({});
      onAdded(out);
    } catch (exc) {
      setRefused(asTetherError(exc));
    } finally {
      setBusy(false);
    }
  };
  const set = (field: string, value: string) => setValues((v) => ({ ...v, [field]: value }));
  return (
    <form className="card stacked" aria-label="New channel" onSubmit={submit}>
      <label>
        Kind
        <select value={kind} onChange={(e) => { setKind(e.target.value as Kind); setValues({}); }}>
          {KINDS.map((k) => <option key={k} value={k}>{k}</option>)}
        </select>
      </label>
      <label>
        Name
        <input name="name" value={name} onChange={(e) => setName(e.target.value)} required autoComplete="off" spellCheck={false} />
      </label>
      <label>
        Agent
        <input name="agent" value={agent} onChange={(e) => setAgent(e.target.value)} autoComplete="off" spellCheck={false} aria-describedby="agent-hint" />
        <span id="agent-hint" className="hint">empty: the tenant's routes (source messaging, channel {kind})</span>
      </label>
      {FIELDS[kind].map((field) => (
        <label key={`${kind}-${field.name}`}>
          {field.label}
          <input
            name={field.name}
            type={field.where === "secrets" ? "password" : "text"}
            autoComplete={field.where === "secrets" ? "new-password" : "off"}
            spellCheck={false}
            required={field.required}
            value={values[field.name] ?? ""}
            onChange={(e) => set(field.name, e.target.value)}
            aria-describedby={field.hint ? `${kind}-${field.name}-hint` : undefined}
          />
          {field.hint && <span id={`${kind}-${field.name}-hint`} className="hint">{field.hint}</span>}
        </label>
      ))}
      <div className="actions">
        <button type="submit" disabled={busy}>Add channel</button>
      </div>
      {refused && (
        <div className="refusal" role="alert">
          <p>The channel was not added.</p>
          <p>{refused.message}</p>
        </div>
      )}
    </form>
  );
}
