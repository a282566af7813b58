import { useCallback, useEffect, useState, type FormEvent } from "react";
import type { ScheduleJson, TetherError } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { SessionEnded } from "./App.js";
import { asTetherError } from "./agents.js";
import { href, onLinkClick } from "./router.js";
import { CATCH_UPS, OVERLAPS, addRequest, nextFire, policies, type ScheduleForm } from "./schedules.js";

const EMPTY: ScheduleForm = { agent: "", cron: "", timezone: "UTC", message: "", overlap: "skip", catchUp: "latest", window: "" };

/** The tenant's schedules: agent, cron and timezone, when each fires next, its last run; pause, resume, remove. */
export function SchedulesPage() {
  const client = useTetherClient();
  const [rows, setRows] = useState<ScheduleJson[] | null>(null);
  const [error, setError] = useState<TetherError | null>(null);
  const load = useCallback(async () => {
    try {
      setRows((await client.listSchedules()).schedules ?? []);
      setError(null);
    } catch (exc) {
      setError(asTetherError(exc));
    }
  }, [client]);
  useEffect(() => {
    void load();
  }, [load]);
  const act = async (call: () => Promise<unknown>) => {
    try {
      await call();
      await load();
    } catch (exc) {
      setError(asTetherError(exc));
    }
  };
  return (
    <section aria-labelledby="schedules-title">
      <div className="title-row">
        <h1 id="schedules-title">Schedules</h1>
      </div>
      {error?.status === "UNAUTHENTICATED" && <SessionEnded />}
      {error && error.status !== "UNAUTHENTICATED" && <p className="tether-error" role="alert">{error.message}</p>}
      <table className="schedules">
        <thead>
          <tr>
            <th scope="col">Agent</th><th scope="col">Cron</th><th scope="col">Next fire</th><th scope="col">Policies</th>
            <th scope="col">Last run</th><th scope="col">Message</th><th scope="col"><span className="visually-hidden">Actions</span></th>
          </tr>
        </thead>
        <tbody>
          {(rows ?? []).map((s) => (
            <tr key={s.scheduleId} data-schedule={s.scheduleId}>
              <td>{s.agent}</td>
              <td><code>{s.cron}</code> {s.timezone}</td>
              <td>{nextFire(s)}</td>
              <td>{policies(s)}</td>
              <td>{s.lastRunId ? <a href={href({ page: "run", runId: s.lastRunId })} onClick={onLinkClick}>{s.lastRunId}</a> : "none yet"}</td>
              <td className="message">{s.message}</td>
              <td>
                <div className="actions">
                  {s.paused
                    ? <button type="button" onClick={() => void act(() => client.resumeSchedule(s.scheduleId ?? ""))}>Resume</button>
                    : <button type="button" onClick={() => void act(() => client.pauseSchedule(s.scheduleId ?? ""))}>Pause</button>}
                  <button type="button" className="quiet" onClick={() => void act(() => client.removeSchedule(s.scheduleId ?? ""))}>Remove</button>
                </div>
              </td>
            </tr>
          ))}
          {rows?.length === 0 && <tr><td colSpan={7} className="empty">No schedules yet.</td></tr>}
        </tbody>
      </table>
      <h2 id="new-schedule">New schedule</h2>
      <AddScheduleForm onAdded={() => void load()} />
    </section>
  );
}

function AddScheduleForm({ onAdded }: { onAdded: () => void }) {
  const client = useTetherClient();
  const [form, setForm] = useState<ScheduleForm>(EMPTY);
  const [busy, setBusy] = useState(false);
  const [refused, setRefused] = useState<string | null>(null);
  const set = (field: keyof ScheduleForm, value: string) => setForm((f) => ({ ...f, [field]: value }));
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (busy) return;
    setBusy(true);
    setRefused(null);
    try {
      await client.addSchedule(addRequest(form));
      setForm(EMPTY);
      onAdded();
    } catch (exc) {
      setRefused(exc instanceof Error && !("status" in exc) ? exc.message : asTetherError(exc).message);
    } finally {
      setBusy(false);
    }
  };
  const text = (field: keyof ScheduleForm, label: string, hint?: string) => (
    <label>
      {label}
      <input name={field} value={form[field]} onChange={(e) => set(field, e.target.value)} autoComplete="off" spellCheck={false}
        required={field !== "window"} aria-describedby={hint ? `${field}-hint` : undefined} />
      {hint && <span id={`${field}-hint`} className="hint">{hint}</span>}
    </label>
  );
  return (
    <form className="card stacked" aria-label="New schedule" onSubmit={submit}>
      {text("agent", "Agent", "one of the tenant's agents")}
      {text("cron", "Cron", "minute hour day-of-month month day-of-week, e.g. 0 9 * * 1-5")}
      {text("timezone", "Timezone", "IANA name, e.g. Europe/Paris")}
      <label>
        Message
        <textarea name="message" value={form.message} onChange={(e) => set("message", e.target.value)} required />
      </label>
      <label>
        Overlap
        <select name="overlap" value={form.overlap} onChange={(e) => set("overlap", e.target.value)}>
          {OVERLAPS.map((o) => <option key={o} value={o}>{o}</option>)}
        </select>
      </label>
      <label>
        Catch-up
        <select name="catchUp" value={form.catchUp} onChange={(e) => set("catchUp", e.target.value)}>
          {CATCH_UPS.map((c) => <option key={c} value={c}>{c}</option>)}
        </select>
      </label>
      {form.catchUp === "all" && text("window", "Catch-up window", "how far back all catches up, e.g. 6h (default 1h, at most 7d)")}
      <div className="actions">
        <button type="submit" disabled={busy}>Add schedule</button>
      </div>
      {refused && (
        <div className="refusal" role="alert">
          <p>The schedule was not added.</p>
          <p>{refused}</p>
        </div>
      )}
    </form>
  );
}
