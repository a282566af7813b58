import { StrictMode } from "react";
import { createRoot } from "react-dom/client";
import { TetherClient } from "@tether/client";
import { TetherProvider } from "@tether/react";
import { App } from "./App.js";
import "./style.css";

// Same-origin cookie session: the API key is exchanged once and never kept by the page.
const client = new TetherClient({ auth: { type: "session" } });

createRoot(document.getElementById("root")!).render(
  <StrictMode>
    <TetherProvider client={client}>
      <App />
    </TetherProvider>
  </StrictMode>,
);
