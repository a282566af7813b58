import type { WaitingForJson } from "@tether/client";

/** What a reason of GetRun's waitingFor says, for a person: whose cap holds the run back. */
const HELD_BY: Record<string, string> = {
  tenant_concurrency: "the tenant's cap",
  agent_concurrency: "its agent's cap",
};

/** The words for why a queued run waits (its reason and cap); "" for none. */
export function waitingWords(waiting: WaitingForJson | undefined): string {
  if (!waiting?.reason) return "";
  const cap = waiting.cap ?? 0;
  const held = HELD_BY[waiting.reason] ?? waiting.reason;
  return `Queued behind ${held}: ${cap} ${cap === 1 ? "run" : "runs"} at once, all running`;
}

/** Why a queued run is not leased yet, when a cap holds it back (nothing otherwise). */
export function WaitingFor({ waiting }: { waiting: WaitingForJson | undefined }) {
  const words = waitingWords(waiting);
  if (!words) return null;
  return (
    <section className="waiting" role="status" aria-label="Waiting" data-testid="waiting-for" data-reason={waiting?.reason}>
      <strong>{words}</strong> <span className="hint">({waiting?.reason}, cap {waiting?.cap ?? 0})</span>
    </section>
  );
}
