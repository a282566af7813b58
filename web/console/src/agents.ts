/** What the agents page says about a document and an answer, kept apart from React to be tested. */
import { TetherError } from "@tether/client";

/** An agent's routes as the list shows them: "source api, channel whatsapp", "any channel". */
export function routesOf(normalised: string | undefined): string[] {
  if (!normalised) return [];
  const routes: unknown = (JSON.parse(normalised) as { routes?: unknown }).routes;
  if (!Array.isArray(routes)) return [];
  return routes.map((route: { source?: string; channel?: string }) => {
    const parts = [route.source ? `source ${route.source}` : "", route.channel ? `channel ${route.channel}` : ""];
    return parts.filter(Boolean).join(", ") || "any run";
  });
}

/**
 * An apply's (or a rollback's) refusal in words: a stale base version (ABORTED, HTTP 409) says
 * what happened and what to do, since the page keeps what the person asked for to redo it on the
 * published version.
 */
export function applyRefusal(
  exc: TetherError,
  base: number | undefined,
  change: "applied" | "rolled back" = "applied",
): { title: string; detail: string } {
  if (exc.status === "ABORTED") {
    const redo = change === "applied" ? "make the change again" : "roll back again if you still want to";
    return {
      title: `Conflict: version ${base ?? "?"} is no longer the published version; nothing was ${change}.`,
      detail: `${exc.message} Load the published version and ${redo}.`,
    };
  }
  if (exc.status === "INVALID_ARGUMENT") return { title: `The document was refused; nothing was ${change}.`, detail: exc.message };
  return { title: `${exc.status}: nothing was ${change}.`, detail: exc.message };
}

export function asTetherError(exc: unknown): TetherError {
  if (exc instanceof TetherError) return exc;
  return new TetherError(0, "UNKNOWN", "unknown", exc instanceof Error ? exc.message : String(exc));
}
