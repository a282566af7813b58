/** A small history router for the console's pages under /console/. */
import { useEffect, useState } from "react";

export const BASE = "/console";

export type Route =
  | { page: "runs" }
  | { page: "run"; runId: string }
  | { page: "connected" }
  | { page: "agents" }
  | { page: "agent"; name: string }
  | { page: "channels" }
  | { page: "channel"; channelId: string }
  | { page: "schedules" }
  | { page: "missing" };

export function parse(pathname: string): Route {
  const rest = pathname.startsWith(BASE) ? pathname.slice(BASE.length) : pathname;
  const parts = rest.split("/").filter(Boolean);
  if (parts.length === 0 || (parts.length === 1 && parts[0] === "runs")) return { page: "runs" };
  if (parts.length === 2 && parts[0] === "runs") return { page: "run", runId: decodeURIComponent(parts[1]!) };
  if (parts.length === 1 && parts[0] === "connected") return { page: "connected" };
  if (parts.length === 1 && parts[0] === "agents") return { page: "agents" };
  if (parts.length === 2 && parts[0] === "agents") return { page: "agent", name: decodeURIComponent(parts[1]!) };
  if (parts.length === 1 && parts[0] === "channels") return { page: "channels" };
  if (parts.length === 2 && parts[0] === "channels") return { page: "channel", channelId: decodeURIComponent(parts[1]!) };
  if (parts.length === 1 && parts[0] === "schedules") return { page: "schedules" };
  return { page: "missing" };
}

export function href(route: Route): string {
  switch (route.page) {
    case "run":
      return `${BASE}/runs/${encodeURIComponent(route.runId)}`;
    case "connected":
      return `${BASE}/connected`;
    case "agents":
      return `${BASE}/agents`;
    case "agent":
      return `${BASE}/agents/${encodeURIComponent(route.name)}`;
    case "channels":
      return `${BASE}/channels`;
    case "channel":
      return `${BASE}/channels/${encodeURIComponent(route.channelId)}`;
    case "schedules":
      return `${BASE}/schedules`;
    default:
      return `${BASE}/`;
  }
}

export function navigate(to: string): void {
  window.history.pushState(null, "", to);
  window.dispatchEvent(new PopStateEvent("popstate"));
}

export function useRoute(): Route {
  const [route, setRoute] = useState(() => parse(window.location.pathname));
  useEffect(() => {
    const on = () => setRoute(parse(window.location.pathname));
    window.addEventListener("popstate", on);
    return () => window.removeEventListener("popstate", on);
  }, []);
  return route;
}

/** A link that navigates without a reload (and with one on a modified click). */
export function onLinkClick(e: React.MouseEvent<HTMLAnchorElement>): void {
  if (e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
  e.preventDefault();
  navigate(e.currentTarget.getAttribute("href") ?? `${BASE}/`);
}
