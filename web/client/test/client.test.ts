import { describe, expect, it } from "vitest";
import { TetherClient, TetherError } from "../src/index.js";
import { FakeFetch, json } from "./fake.js";

const NOT_FOUND = { error: { status: "NOT_FOUND", code: "not_found", message: "run 'run_x' not found" } };

describe("errors", () => {
  it("turns the JSON error body into a TetherError with status, code and message", async () => {
    const fake = new FakeFetch().on("GET", "/v2/runs/run_x", () => json(404, NOT_FOUND));
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk_1" } });
    const err = await client.getRun("run_x").catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TetherError);
    const t = err as TetherError;
    expect([t.httpStatus, t.status, t.code, t.message]).toEqual([404, "NOT_FOUND", "not_found", "run 'run_x' not found"]);
    expect(t.retryable).toBe(false);
  });

  it("still gives a TetherError for a body that is not the error shape", async () => {
    const fake = new FakeFetch().on("GET", "/v2/runs", () => new Response("<html>bad gateway</html>", { status: 502 }));
    const client = new TetherClient({ fetch: fake.fetch });
    const t = (await client.listRuns().catch((e: unknown) => e)) as TetherError;
    expect([t.httpStatus, t.status, t.code]).toEqual([502, "INTERNAL", "internal"]);
  });

  it("reports a network failure as a retryable NETWORK error", async () => {
    const client = new TetherClient({ fetch: () => Promise.reject(new TypeError("Failed to fetch")) });
    const t = (await client.listRuns().catch((e: unknown) => e)) as TetherError;
    expect([t.status, t.httpStatus, t.retryable]).toEqual(["NETWORK", 0, true]);
  });
});

describe("cookie sessions", () => {
  it("sends the CSRF token on mutations only, with same-origin credentials", async () => {
    const fake = new FakeFetch()
      .on("POST", "/v2/session", () => json(201, { csrfToken: "csrf-1", tenantId: "t1", principal: "p", scopes: [] }))
      .on("GET", "/v2/runs/run_1", () => json(200, { run: { runId: "run_1" } }))
      .on("POST", "/v2/runs/run_1/answer", () => json(200, { interactionId: "i1", resumed: true }))
      .on("DELETE", "/v2/session", () => json(204, null));
    const client = new TetherClient({ fetch: fake.fetch });
    await client.signIn("tk_secret");
    await client.getRun("run_1");
    await client.answerQuestion("run_1", { color: { values: ["red"] } });
    await client.signOut();

    const [signIn, get, answer, signOut] = fake.requests;
    expect(signIn!.body).toEqual({ apiKey: "tk_secret" });
    expect(signIn!.url).toBe("/v2/session"); // the key goes in the body, never the URL
    expect(get!.headers["X-CSRF-Token"]).toBeUndefined();
    expect(answer!.headers["X-CSRF-Token"]).toBe("csrf-1");
    expect(answer!.body).toEqual({ answers: { color: { values: ["red"] } } });
    expect(signOut!.headers["X-CSRF-Token"]).toBe("csrf-1");
    expect(fake.requests.every((r) => r.credentials === "same-origin")).toBe(true);
    expect(fake.requests.some((r) => "Authorization" in r.headers)).toBe(false);
    expect(client.hasSession).toBe(false);
  });

  it("recovers the CSRF token after a reload from GET /v2/session", async () => {
    const fake = new FakeFetch()
      .on("GET", "/v2/session", () => json(200, { csrfToken: "csrf-2" }))
      .on("POST", "/v2/runs/run_1/cancel", () => json(200, { changed: true }));
    const client = new TetherClient({ fetch: fake.fetch });
    await client.getSession();
    await client.cancelRun("run_1", "stop");
    expect(fake.calls("POST", "/v2/runs/run_1/cancel")[0]!.headers["X-CSRF-Token"]).toBe("csrf-2");
  });
});

describe("bearer tokens", () => {
  it("sends a static token and does not retry a 401", async () => {
    const fake = new FakeFetch().on("GET", "/v2/runs", () =>
      json(401, { error: { status: "UNAUTHENTICATED", code: "unauthenticated", message: "bad key" } }),
    );
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk_a" } });
    const t = (await client.listRuns().catch((e: unknown) => e)) as TetherError;
    expect(t.status).toBe("UNAUTHENTICATED");
    expect(fake.requests).toHaveLength(1);
    expect(fake.requests[0]!.headers["Authorization"]).toBe("Bearer tk_a");
    expect(fake.requests[0]!.credentials).toBe("omit");
    expect(fake.requests[0]!.headers["X-CSRF-Token"]).toBeUndefined();
  });

  it("refreshes a short-lived token once on 401 and retries the call", async () => {
    const expired = () => json(401, { error: { status: "UNAUTHENTICATED", code: "unauthenticated", message: "token expired" } });
    const fake = new FakeFetch().on("POST", "/v2/runs/run_1/decision", expired, () => json(200, { resumed: true }));
    const asked: boolean[] = [];
    let n = 0;
    const client = new TetherClient({
      fetch: fake.fetch,
      auth: { type: "bearer", getToken: ({ refresh }) => { asked.push(refresh); return `tt_${++n}`; } },
    });
    const out = await client.decideApproval("run_1", { decision: "allow-once" });
    expect(out).toEqual({ resumed: true });
    expect(asked).toEqual([false, true]);
    expect(fake.requests.map((r) => r.headers["Authorization"])).toEqual(["Bearer tt_1", "Bearer tt_2"]);
  });

  it("gives up after one refresh", async () => {
    const fake = new FakeFetch().on("GET", "/v2/runs", () =>
      json(401, { error: { status: "UNAUTHENTICATED", code: "unauthenticated", message: "revoked" } }),
    );
    let n = 0;
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", getToken: () => `tt_${++n}` } });
    const t = (await client.listRuns().catch((e: unknown) => e)) as TetherError;
    expect(t.message).toBe("revoked");
    expect(fake.requests).toHaveLength(2);
  });
});

describe("routes", () => {
  it("escapes identifiers and sends list filters as the contract names them", async () => {
    const fake = new FakeFetch()
      .on("GET", "/v2/runs", () => json(200, { runs: [] }))
      .on("GET", /^\/v2\/runs\/.+$/, () => json(200, {}));
    const client = new TetherClient({ fetch: fake.fetch, baseUrl: "http://gw:8080/" });
    await client.listRuns({ statuses: ["RUN_STATUS_RUNNING", "RUN_STATUS_QUEUED"], conversationId: "c 1", pageSize: 20 });
    await client.getRun("../x?y", { includeSuperseded: true });
    await client.listRuns({ treeRootRunId: "run_root", pageToken: "p2" });
    expect(fake.requests[0]!.url).toBe(
      "http://gw:8080/v2/runs?status=RUN_STATUS_RUNNING&status=RUN_STATUS_QUEUED&conversationId=c+1&pageSize=20",
    );
    expect(fake.requests[1]!.url).toBe("http://gw:8080/v2/runs/..%2Fx%3Fy?includeSuperseded=true");
    expect(fake.requests[2]!.url).toBe("http://gw:8080/v2/runs?pageToken=p2&treeRootRunId=run_root");
  });

  it("sends the Idempotency-Key header with a message", async () => {
    const fake = new FakeFetch().on("POST", "/v2/messages", () => json(200, { disposition: "DISPOSITION_CREATED", run: { runId: "r" } }));
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "k" } });
    const out = await client.sendMessage({ eventId: "e1", conversationId: "c1", text: "hi" }, { idempotencyKey: "e1" });
    expect(out.run?.runId).toBe("r");
    expect(fake.requests[0]!.headers["Idempotency-Key"]).toBe("e1");
    expect(fake.requests[0]!.body).toEqual({ eventId: "e1", conversationId: "c1", text: "hi" });
  });
});

describe("agents", () => {
  it("calls the /v2/agents routes with the name escaped and the bodies in the JSON mapping", async () => {
    const fake = new FakeFetch()
      .on("POST", "/v2/agents", () => json(201, { name: "sup@port", version: 1, created: true }))
      .on("GET", "/v2/agents/sup%40port", () => json(200, { agent: { name: "sup@port", version: 1 } }))
      .on("GET", "/v2/agents/sup%40port/versions", () => json(200, { versions: [{ version: 1 }] }))
      .on("POST", "/v2/agents/sup%40port/rollback", () => json(200, { name: "sup@port", version: 1 }))
      .on("POST", "/v2/agents/sup%40port/default", () => json(200, { name: "sup@port" }))
      .on("DELETE", "/v2/agents/sup%40port", () => json(200, { name: "sup@port", version: 1 }));
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk_1" } });
    expect(await client.applyAgent({ spec: "name: sup@port\n", baseVersion: 0 })).toEqual({ name: "sup@port", version: 1, created: true });
    expect((await client.getAgent("sup@port", 1)).agent?.version).toBe(1);
    expect((await client.listAgentVersions("sup@port")).versions).toHaveLength(1);
    await client.rollbackAgent("sup@port", 1);
    await client.rollbackAgent("sup@port", 1, 3);
    await client.setDefaultAgent("sup@port");
    await client.removeAgent("sup@port");
    const [apply, get, , rollback, conditional] = fake.requests;
    expect(get!.url).toBe("/v2/agents/sup%40port?version=1");
    expect(apply!.body).toEqual({ spec: "name: sup@port\n", baseVersion: 0 });
    expect(rollback!.body).toEqual({ toVersion: 1 });
    expect(conditional!.body).toEqual({ toVersion: 1, baseVersion: 3 });
    expect(fake.requests.map((r) => r.method)).toEqual(["POST", "GET", "GET", "POST", "POST", "POST", "DELETE"]);
  });

  it("lists the tool catalog from /v2/tools", async () => {
    const tool = { name: "get_time", risk: "read", schemaSha256: "ab".repeat(32), announcedBy: "w-1" };
    const fake = new FakeFetch().on("GET", "/v2/tools", () => json(200, { tools: [tool] }));
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk_1" } });
    expect((await client.listTools()).tools).toEqual([tool]);
    expect(fake.requests.map((r) => `${r.method} ${r.url}`)).toEqual(["GET /v2/tools"]);
  });

  it("renders an agent's request for a message at /v2/agents/{name}/render", async () => {
    const fake = new FakeFetch().on("POST", "/v2/agents/sup%40port/render", () =>
      json(200, { agent: "sup@port", version: 2, requestJson: "{}", estimatedInputTokens: "12" }),
    );
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk_1" } });
    const out = await client.renderAgent("sup@port", { message: "hi", source: "", channel: "whatsapp" });
    expect(out.estimatedInputTokens).toBe("12");
    expect(fake.requests[0]!.body).toEqual({ message: "hi", source: "", channel: "whatsapp" });
  });

  it("adds, lists, shows, rotates and removes channels under /v2/channels", async () => {
    const info = { channelId: "ch/1", kind: "slack", name: "demo", secrets: [{ name: "signing_secret", lastFour: "cret" }] };
    const fake = new FakeFetch()
      .on("POST", "/v2/channels", () => json(201, { channelId: "ch/1", webhookUrl: "http://gw/v2/webhooks/slack/ch/1", channel: info }))
      .on("GET", "/v2/channels", () => json(200, { channels: [info] }))
      .on("GET", "/v2/channels/ch%2F1", () => json(200, { channel: info, webhookUrl: "http://gw/x" }))
      .on("POST", "/v2/channels/ch%2F1/rotate-secret", () => json(200, { channel: info }))
      .on("DELETE", "/v2/channels/ch%2F1", () => json(200, { channelId: "ch/1" }));
    const client = new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk_1" } });
    const added = await client.addChannel({ kind: "slack", name: "demo", secrets: { signingSecret: "s", botToken: "b" } });
    expect(added.webhookUrl).toBe("http://gw/v2/webhooks/slack/ch/1");
    expect((await client.listChannels()).channels).toEqual([info]);
    expect((await client.getChannel("ch/1")).webhookUrl).toBe("http://gw/x");
    await client.rotateChannelSecret("ch/1", "new", 3600);
    await client.rotateChannelSecret("ch/1", "newer");
    expect((await client.removeChannel("ch/1")).channelId).toBe("ch/1");
    expect(fake.requests.map((r) => `${r.method} ${r.url}`)).toEqual([
      "POST /v2/channels",
      "GET /v2/channels",
      "GET /v2/channels/ch%2F1",
      "POST /v2/channels/ch%2F1/rotate-secret",
      "POST /v2/channels/ch%2F1/rotate-secret",
      "DELETE /v2/channels/ch%2F1",
    ]);
    expect(fake.requests[3]!.body).toEqual({ secret: "new", graceSeconds: "3600" });
    expect(fake.requests[4]!.body).toEqual({ secret: "newer" });
  });
});
