/**
 * Embeddable cards for the three pauses: a question form, an approval, a connection offer.
 * Plain markup with `tether-*` class names (style them as you like; the console's CSS is one
 * example); every control is labelled and keyboard reachable. A card that was answered, decided
 * or completed cannot be acted on again.
 */
import { useId, useState, type FormEvent } from "react";
import type { PendingApprovalJson, PendingConnectionJson, PendingQuestionJson, QuestionSpecJson } from "@tether/client";
import { useAnswerQuestion, useDecideApproval, type Decision } from "./hooks.js";

export function formatMicros(micros: string | number | undefined): string {
  const n = Number(micros ?? 0) / 1_000_000;
  if (n === 0) return "$0";
  return n < 0.01 ? `$${n.toFixed(6).replace(/0+$/, "")}` : `$${n.toFixed(2)}`;
}

function ErrorLine({ message }: { message: string | undefined }) {
  return message ? <p className="tether-error" role="alert">{message}</p> : null;
}

const OTHER = "\u0000other";

function QuestionField({ spec, value, onChange }: { spec: QuestionSpecJson; value: string[]; onChange: (v: string[]) => void }) {
  const id = useId();
  const [other, setOther] = useState("");
  const options = spec.options ?? [];
  const key = spec.key ?? "";
  if (options.length === 0) {
    return (
      <div className="tether-field">
        <label htmlFor={id}>{spec.prompt || key}</label>
        <textarea id={id} name={key} value={value[0] ?? ""} onChange={(e) => onChange([e.target.value])} rows={2} />
      </div>
    );
  }
  const chosen = new Set(value.filter((v) => v !== OTHER && !v.startsWith(OTHER)));
  const otherOn = value.some((v) => v.startsWith(OTHER));
  const emit = (next: Set<string>, otherOnNext: boolean, otherText: string) => {
    const out = [...next];
    if (otherOnNext) out.push(OTHER + otherText);
    onChange(out);
  };
  const type = spec.multiple ? "checkbox" : "radio";
  return (
    <fieldset className="tether-field">
      <legend>{spec.prompt || key}</legend>
      {options.map((option) => (
        <label key={option} className="tether-option">
          <input
            type={type}
            name={`${id}-${key}`}
            value={option}
            checked={chosen.has(option)}
            onChange={(e) => {
              const next = spec.multiple ? new Set(chosen) : new Set<string>();
              if (e.target.checked) next.add(option);
              else next.delete(option);
              emit(next, spec.multiple ? otherOn : false, other);
            }}
          />
          {option}
        </label>
      ))}
      {spec.allowOther && (
        <span className="tether-option tether-other">
          <label>
            <input
              type={type}
              name={`${id}-${key}`}
              value="other"
              checked={otherOn}
              onChange={(e) => emit(spec.multiple ? chosen : new Set(), e.target.checked, other)}
            />
            Other
          </label>
          <input
            type="text"
            aria-label={`Other answer for ${spec.prompt || key}`}
            value={other}
            onChange={(e) => {
              setOther(e.target.value);
              emit(spec.multiple ? chosen : new Set(), true, e.target.value); // typing picks "other"
            }}
          />
        </span>
      )}
    </fieldset>
  );
}

/** Answers a pending question: options (one or several), "other", or free text. */
export function QuestionCard({ runId, question, onAnswered, resolvedElsewhere = false }: { runId: string; question: PendingQuestionJson; onAnswered?: (resumed: boolean) => void; resolvedElsewhere?: boolean }) {
  const answer = useAnswerQuestion(runId, question.interactionId);
  const [values, setValues] = useState<Record<string, string[]>>({});
  const specs = question.questions ?? [];
  const resolved = answer.result !== null || resolvedElsewhere;
  const complete = specs.every((s) => (values[s.key ?? ""] ?? []).some((v) => clean(v) !== ""));
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    if (resolved || answer.submitting || !complete) return;
    const answers = Object.fromEntries(specs.map((s) => [s.key ?? "", { values: (values[s.key ?? ""] ?? []).map(clean).filter((v) => v !== "") }]));
    const out = await answer.run(answers);
    if (out) onAnswered?.(out.resumed ?? false);
  };
  return (
    <form className="tether-card tether-question" aria-label="Question" onSubmit={submit}>
      <h3>Question</h3>
      <fieldset disabled={resolved || answer.submitting} className="tether-plain">
        {specs.map((spec) => (
          <QuestionField key={spec.key} spec={spec} value={values[spec.key ?? ""] ?? []} onChange={(v) => setValues((all) => ({ ...all, [spec.key ?? ""]: v }))} />
        ))}
        <button type="submit" disabled={!complete || resolved || answer.submitting}>Send answer</button>
      </fieldset>
      {answer.result !== null && <p className="tether-resolved" role="status">Answered{answer.result.resumed ? "; the run resumes." : "."}</p>}
      {answer.result === null && resolvedElsewhere && <p className="tether-resolved" role="status">This question is no longer open.</p>}
      <ErrorLine message={answer.error?.message} />
    </form>
  );
}

function clean(v: string): string {
  return (v.startsWith(OTHER) ? v.slice(OTHER.length) : v).trim();
}

const DECISIONS: { decision: Decision; label: string }[] = [
  { decision: "allow-once", label: "Allow once" },
  { decision: "allow-conversation", label: "Allow for this conversation" },
  { decision: "allow-always", label: "Always allow" },
  { decision: "deny", label: "Deny" },
];

/** Decides a pending approval: shows what will run, exactly, and the decisions policy allows. */
export function ApprovalCard({ runId, approval, onDecided, resolvedElsewhere = false }: { runId: string; approval: PendingApprovalJson; onDecided?: (decision: Decision) => void; resolvedElsewhere?: boolean }) {
  const decide = useDecideApproval(runId, approval.interactionId);
  const [chosen, setChosen] = useState<Decision | null>(null);
  const allowed = approval.allowedDecisions ?? [];
  const offered = DECISIONS.filter((d) => (d.decision === "allow-always" ? allowed.includes(d.decision) : allowed.length === 0 || allowed.includes(d.decision)));
  const resolved = decide.result !== null || resolvedElsewhere;
  const act = async (decision: Decision) => {
    if (resolved || decide.submitting) return;
    setChosen(decision);
    const out = await decide.run(decision);
    if (out) onDecided?.(decision);
  };
  return (
    <section className="tether-card tether-approval" aria-label="Approval">
      <h3>Approval needed</h3>
      <dl className="tether-facts">
        <dt>Tool</dt>
        <dd><code>{approval.toolName}</code></dd>
        <dt>Summary</dt>
        <dd>{approval.summary}</dd>
        <dt>Risk</dt>
        <dd>{approval.riskCategory || "unspecified"}</dd>
        <dt>Estimated cost</dt>
        <dd>{formatMicros(approval.estimatedCostMicros)}</dd>
        {approval.expiresAt && (
          <>
            <dt>Expires</dt>
            <dd><time dateTime={approval.expiresAt}>{new Date(approval.expiresAt).toLocaleString()}</time></dd>
          </>
        )}
      </dl>
      <p className="tether-label">The exact input that will run:</p>
      <pre className="tether-input" tabIndex={0} aria-label="Tool input">{JSON.stringify(approval.input ?? {}, null, 2)}</pre>
      <div className="tether-actions" role="group" aria-label="Decision">
        {offered.map((d) => (
          <button key={d.decision} type="button" className={d.decision === "deny" ? "tether-deny" : ""} disabled={resolved || decide.submitting} onClick={() => void act(d.decision)}>
            {d.label}
          </button>
        ))}
      </div>
      {decide.result !== null && <p className="tether-resolved" role="status">Decided: {DECISIONS.find((d) => d.decision === chosen)?.label}{decide.result.resumed ? "; the run resumes." : "."}</p>}
      {decide.result === null && resolvedElsewhere && <p className="tether-resolved" role="status">This approval is no longer open.</p>}
      <ErrorLine message={decide.error?.message} />
    </section>
  );
}

const GAP_WORDS: Record<string, (provider: string, scopes: string) => string> = {
  CONNECTION_GAP_ABSENT: (p) => `You have not connected ${p} yet.`,
  CONNECTION_GAP_EXPIRED: (p) => `Your ${p} connection has expired; sign in again to renew it.`,
  CONNECTION_GAP_INSUFFICIENT_SCOPE: (p, s) => `Your ${p} connection is missing a permission this needs${s ? ` (${s})` : ""}; sign in again to grant it.`,
};

/** Where the console's /connected page finds the run a login round trip was for. */
export const CONNECT_STORAGE_PREFIX = "tether.connect.";

/** Offers the login for a missing, expired or too narrow connection. */
export function ConnectionCard({ runId, connection, resolvedElsewhere = false }: { runId: string; connection: PendingConnectionJson; resolvedElsewhere?: boolean }) {
  const provider = connection.provider || "the provider";
  const scopes = (connection.scopes ?? []).join(", ");
  const words = GAP_WORDS[connection.gap ?? ""]?.(provider, scopes) ?? `${provider} needs a connection.`;
  const [opened, setOpened] = useState(false);
  const remember = () => {
    // The OAuth state names the round trip: the landing page maps it back to this run.
    try {
      const state = new URL(connection.loginUrl ?? "", window.location.href).searchParams.get("state");
      if (state) window.sessionStorage.setItem(CONNECT_STORAGE_PREFIX + state, runId);
    } catch {
      /* no storage: the landing page asks for the run */
    }
    setOpened(true);
  };
  return (
    <section className="tether-card tether-connection" aria-label="Connection">
      <h3>Connect {provider}</h3>
      <p>{words}</p>
      {scopes && <p className="tether-label">Permissions asked for: {scopes}</p>}
      {resolvedElsewhere ? (
        <p className="tether-resolved" role="status">This connection request is no longer open.</p>
      ) : connection.loginUrl ? (
        <a className="tether-button" href={connection.loginUrl} onClick={remember} rel="noopener noreferrer" aria-disabled={opened}>
          Sign in to {provider}
        </a>
      ) : (
        <p className="tether-error">No login link is available.</p>
      )}
    </section>
  );
}
