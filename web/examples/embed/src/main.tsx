/**
 * A product's page embedding Tether's cards: one run's status and its pending interaction.
 * The page never sees an API key: its own backend mints short-lived tokens (`POST /token`,
 * which calls the gateway's `POST /v2/tokens` with the key it keeps), and the client asks for a
 * new one when the gateway answers 401.
 */
import { StrictMode } from "react";
import { createRoot } from "react-dom/client";
import { TetherClient } from "@tether/client";
import { ApprovalCard, ConnectionCard, QuestionCard, TetherProvider, useRun } from "@tether/react";
import "../../../console/src/style.css";

const params = new URLSearchParams(window.location.search);
const gateway = params.get("gateway") ?? "";
const runId = new URLSearchParams(window.location.hash.slice(1)).get("run") ?? "";

const client = new TetherClient({
  baseUrl: gateway,
  auth: {
    type: "bearer",
    getToken: async () => {
      const minted = await fetch("/token", { method: "POST" });
      if (!minted.ok) throw new Error(`the backend minted no token (${minted.status})`);
      return ((await minted.json()) as { token: string }).token;
    },
  },
});

function Embedded() {
  const { state, error } = useRun(runId);
  const pending = state.pending;
  if (error) return <p className="tether-error" role="alert">{error.message}</p>;
  return (
    <main className="page">
      <h1>Your request</h1>
      <p>Status: <span data-testid="embed-status">{state.run?.status ?? "loading"}</span></p>
      {pending?.type === "question" && pending.question && <QuestionCard runId={runId} question={pending.question} />}
      {pending?.type === "approval" && pending.approval && <ApprovalCard runId={runId} approval={pending.approval} />}
      {pending?.type === "connection" && pending.connection && <ConnectionCard runId={runId} connection={pending.connection} />}
      {state.run?.resultText && <p data-testid="embed-result">{state.run.resultText}</p>}
    </main>
  );
}

createRoot(document.getElementById("root")!).render(
  <StrictMode>
    <TetherProvider client={client}>
      <Embedded />
    </TetherProvider>
  </StrictMode>,
);
