/** A scripted fetch for unit tests: each call is answered by the next handler that matches. */

export interface Recorded {
  method: string;
  url: string;
  headers: Record<string, string>;
  body: unknown;
  credentials: RequestCredentials | undefined;
}

export type Answer = (request: Recorded, signal?: AbortSignal) => Response | Promise<Response>;

export class FakeFetch {
  readonly requests: Recorded[] = [];
  private readonly routes: { method: string; path: string | RegExp; answers: Answer[] }[] = [];

  /** Answers `method path` with these, one per call (the last one repeats). */
  on(method: string, path: string | RegExp, ...answers: Answer[]): this {
    this.routes.push({ method, path, answers });
    return this;
  }

  readonly fetch = async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
    const url = String(input);
    const method = (init?.method ?? "GET").toUpperCase();
    const headers = Object.fromEntries(Object.entries((init?.headers ?? {}) as Record<string, string>));
    const body = typeof init?.body === "string" ? JSON.parse(init.body) : undefined;
    const recorded: Recorded = { method, url, headers, body, credentials: init?.credentials };
    this.requests.push(recorded);
    const pathname = url.replace(/^https?:\/\/[^/]+/, "").split("?")[0] ?? "";
    for (const route of this.routes) {
      const matches = typeof route.path === "string" ? route.path === pathname : route.path.test(pathname);
      if (route.method === method && matches) {
        const answer = route.answers.length > 1 ? route.answers.shift()! : route.answers[0]!;
        return answer(recorded, init?.signal ?? undefined);
      }
    }
    return json(404, { error: { status: "NOT_FOUND", code: 404, message: `no route ${method} ${pathname}` } });
  };

  calls(method: string, path: string): Recorded[] {
    return this.requests.filter((r) => r.method === method && r.url.replace(/^https?:\/\/[^/]+/, "").split("?")[0] === path);
  }
}

export function json(status: number, body: unknown): Response {
  return new Response(status === 204 ? null : JSON.stringify(body), {
    status,
    headers: { "Content-Type": "application/json" },
  });
}

/**
 * An SSE response sending `chunks`, then either ending or breaking (a network error) when
 * `breakAfter` is set. `hold` keeps it open until the request is aborted.
 */
export function sse(chunks: string[], opts: { break?: boolean; hold?: boolean } = {}): Answer {
  return (_request, signal) => {
    const encoder = new TextEncoder();
    let next = 0;
    const stream = new ReadableStream<Uint8Array>({
      // One chunk per read, so a break comes after what was sent before it.
      pull(controller) {
        if (next < chunks.length) {
          controller.enqueue(encoder.encode(chunks[next++]!));
        } else if (opts.break) {
          controller.error(new TypeError("network error"));
        } else if (opts.hold) {
          return new Promise<void>((resolve) => {
            const stop = () => {
              controller.error(new DOMException("aborted", "AbortError"));
              resolve();
            };
            if (signal?.aborted) stop();
            else signal?.addEventListener("abort", stop, { once: true });
          });
        } else {
          controller.close();
        }
        return undefined;
      },
    });
    return new Response(stream, { status: 200, headers: { "Content-Type": "text/event-stream" } });
  };
}

/** One SSE frame. */
export function frame(event: string, data: unknown, id?: number | string): string {
  return `${id !== undefined ? `id: ${id}\n` : ""}event: ${event}\ndata: ${JSON.stringify(data)}\n\n`;
}

/** A durable run event frame as the bridge sends it. */
export function runEvent(runId: string, seq: number, type: string, payload: Record<string, unknown> = {}): string {
  return frame(type, { event: { runId, seq: String(seq), type, createdAt: "2026-12-03T10:00:00Z", ...payload } }, seq);
}
