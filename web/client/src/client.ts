/**
 * The v2 HTTP/SSE bridge, typed by the protos: every request and response body is the gRPC
 * message in protobuf's JSON mapping, so the generated `*Json` types describe them.
 */
import type { RunJson, RunStatusJson } from "./gen/tether/v1/common_pb.js";
import type {
  AddChannelRequestJson,
  AddChannelResponseJson,
  GetChannelResponseJson,
  ListChannelsResponseJson,
  RemoveChannelResponseJson,
  RotateChannelSecretResponseJson,
  AddScheduleRequestJson,
  AddScheduleResponseJson,
  ListSchedulesResponseJson,
  PauseScheduleResponseJson,
  RemoveScheduleResponseJson,
  ResumeScheduleResponseJson,
  AddDocumentRequestJson,
  AddDocumentResponseJson,
  ApplyAgentRequestJson,
  ApplyAgentResponseJson,
  GetAgentResponseJson,
  ListAgentsResponseJson,
  ListAgentVersionsResponseJson,
  ListToolsResponseJson,
  RemoveAgentResponseJson,
  RenderAgentRequestJson,
  RenderAgentResponseJson,
  RollbackAgentResponseJson,
  SetDefaultAgentResponseJson,
  AnswerQuestionRequestJson,
  AnswerQuestionResponseJson,
  CancelRunResponseJson,
  CompleteConnectionRequestJson,
  CompleteConnectionResponseJson,
  DecideApprovalRequestJson,
  DecideApprovalResponseJson,
  GetPendingApprovalResponseJson,
  GetPendingConnectionResponseJson,
  GetPendingQuestionResponseJson,
  GetRunAttemptsResponseJson,
  GetRunResponseJson,
  ListDocumentsResponseJson,
  ListRunsResponseJson,
  RemoveDocumentResponseJson,
  RetryRunResponseJson,
  SendMessageRequestJson,
  SendMessageResponseJson,
} from "./gen/tether/v1/gateway_pb.js";
import { TetherError } from "./errors.js";
import {
  conversationStream,
  liveRuns,
  runStream,
  type ConversationStreamOptions,
  type ConversationStreamItem,
  type LiveRunsItem,
  type LiveRunsOptions,
  type RunStreamItem,
  type RunStreamOptions,
} from "./streams.js";

/** How the client authenticates. */
export type Auth =
  /** The console's same-origin HttpOnly cookie; mutations carry the session's CSRF token. */
  | { type: "session" }
  /**
   * `Authorization: Bearer ...`: a fixed key or token, or `getToken` for short-lived tokens
   * (called with `refresh: true` once when the server answers 401, then the call is retried).
   */
  | { type: "bearer"; token?: string; getToken?: (opts: { refresh: boolean }) => string | Promise<string> };

export interface ClientOptions {
  /** Where the gateway's HTTP address is; "" (the default) for the page's own origin. */
  baseUrl?: string;
  auth?: Auth;
  /** A fetch implementation (tests, server-side rendering); the global one by default. */
  fetch?: typeof fetch;
  /** Reconnect delays of the streams: first and largest, in milliseconds. */
  reconnect?: { initialMs?: number; maxMs?: number };
}

/** `POST /v2/session`'s and `GET /v2/session`'s body. */
export interface SessionJson {
  csrfToken: string;
  expiresAt?: string;
  tenantId?: string;
  principal?: string;
  scopes?: string[];
}

/** `POST /v2/tokens`' body. */
export interface TokenJson {
  token: string;
  expiresAt?: string;
  scopes?: string[];
}

export interface ListRunsQuery {
  statuses?: RunStatusJson[];
  conversationId?: string;
  pageSize?: number;
  pageToken?: string;
  createdAfter?: string;
  /** Every run of this run tree (the root and the runs its delegate calls started). */
  treeRootRunId?: string;
}

export interface RequestOptions {
  signal?: AbortSignal;
  headers?: Record<string, string>;
}

const SAFE_METHODS = new Set(["GET", "HEAD", "OPTIONS"]);

export class TetherClient {
  readonly baseUrl: string;
  readonly auth: Auth;
  readonly reconnectInitialMs: number;
  readonly reconnectMaxMs: number;
  private readonly fetchImpl: typeof fetch;
  private csrfToken: string | undefined;
  private token: string | undefined;
  private stale = false;

  constructor(options: ClientOptions = {}) {
    this.baseUrl = (options.baseUrl ?? "").replace(/\/+$/, "");
    this.auth = options.auth ?? { type: "session" };
    const f = options.fetch ?? globalThis.fetch;
    this.fetchImpl = (input, init) => f(input, init);
    this.reconnectInitialMs = options.reconnect?.initialMs ?? 250;
    this.reconnectMaxMs = options.reconnect?.maxMs ?? 5000;
    if (this.auth.type === "bearer") this.token = this.auth.token;
  }

  // ---- the low level: one authenticated request, 401 refreshed once --------------------

  /**
   * Sends a request with the client's credentials and returns the response when it is 2xx;
   * otherwise throws the body's TetherError. A bearer client with `getToken` refreshes its
   * token once on 401 and sends the request again.
   */
  async send(method: string, path: string, init: { body?: unknown; headers?: Record<string, string>; signal?: AbortSignal } = {}): Promise<Response> {
    let refreshed = false;
    for (;;) {
      const headers: Record<string, string> = { Accept: "application/json", ...init.headers };
      const request: RequestInit = { method, headers };
      if (init.signal) request.signal = init.signal;
      if (init.body !== undefined) {
        headers["Content-Type"] = "application/json";
        request.body = JSON.stringify(init.body);
      }
      await this.authorize(method, headers, request, refreshed);
      let response: Response;
      try {
        response = await this.fetchImpl(this.baseUrl + path, request);
      } catch (exc) {
        if (isAbort(exc)) throw exc;
        throw new TetherError(0, "NETWORK", "network", exc instanceof Error ? exc.message : String(exc));
      }
      if (response.ok) return response;
      if (response.status === 401 && !refreshed && this.canRefresh()) {
        refreshed = true;
        await response.body?.cancel().catch(() => undefined);
        continue;
      }
      throw await TetherError.fromResponse(response);
    }
  }

  /** A JSON call: the parsed body of a 2xx answer (`{}` for 204). */
  async call<T>(method: string, path: string, body?: unknown, options: RequestOptions = {}): Promise<T> {
    const init: { body?: unknown; headers?: Record<string, string>; signal?: AbortSignal } = { body };
    if (options.signal) init.signal = options.signal;
    if (options.headers) init.headers = options.headers;
    const response = await this.send(method, path, init);
    const text = await response.text();
    return (text ? JSON.parse(text) : {}) as T;
  }

  /** Whether the client can get a new token (a bearer client with `getToken`). */
  canRefresh(): boolean {
    return this.auth.type === "bearer" && this.auth.getToken !== undefined;
  }

  /**
   * Forgets the current token, so the next request asks `getToken({refresh: true})` for a new
   * one (a stream whose token expired mid-way reconnects with a fresh token).
   */
  invalidateToken(): void {
    if (this.canRefresh()) this.stale = true;
  }

  private async authorize(method: string, headers: Record<string, string>, request: RequestInit, refresh: boolean): Promise<void> {
    if (this.auth.type === "bearer") {
      request.credentials = "omit";
      if (this.auth.getToken && (refresh || this.stale || this.token === undefined)) {
        const renew = refresh || this.stale;
        this.stale = false;
        this.token = await this.auth.getToken({ refresh: renew });
      }
      if (this.token) headers["Authorization"] = `Bearer ${this.token}`;
      return;
    }
    request.credentials = "same-origin";
    if (!SAFE_METHODS.has(method.toUpperCase()) && this.csrfToken) {
      headers["X-CSRF-Token"] = this.csrfToken;
    }
  }

  // ---- sign-in (cookie sessions) and tokens ---------------------------------------------

  /** Exchanges an API key for the session cookie (the key is sent once and not kept). */
  async signIn(apiKey: string): Promise<SessionJson> {
    const session = await this.call<SessionJson>("POST", "/v2/session", { apiKey });
    this.csrfToken = session.csrfToken;
    return session;
  }

  /** The current session (after a reload: the cookie is still there, the CSRF token is not). */
  async getSession(options: RequestOptions = {}): Promise<SessionJson> {
    const session = await this.call<SessionJson>("GET", "/v2/session", undefined, options);
    this.csrfToken = session.csrfToken;
    return session;
  }

  /** Revokes the session server-side; the cookie no longer works anywhere. */
  async signOut(): Promise<void> {
    await this.call("DELETE", "/v2/session");
    this.csrfToken = undefined;
  }

  /** Whether the client holds a CSRF token (a session it signed in or read). */
  get hasSession(): boolean {
    return this.csrfToken !== undefined;
  }

  /** Mints a short-lived token (a backend's call, with an API key as the bearer). */
  createToken(body: { ttlSeconds?: number; scopes?: string[] } = {}): Promise<TokenJson> {
    return this.call("POST", "/v2/tokens", body);
  }

  // ---- the gateway's calls ---------------------------------------------------------------

  /** SendMessage; `idempotencyKey` is sent as the Idempotency-Key header. */
  sendMessage(body: SendMessageRequestJson, options: RequestOptions & { idempotencyKey?: string } = {}): Promise<SendMessageResponseJson> {
    const headers = { ...options.headers };
    if (options.idempotencyKey) headers["Idempotency-Key"] = options.idempotencyKey;
    return this.call("POST", "/v2/messages", body, { ...options, headers });
  }

  listRuns(query: ListRunsQuery = {}, options: RequestOptions = {}): Promise<ListRunsResponseJson> {
    return this.call("GET", `/v2/runs${listQuery(query)}`, undefined, options);
  }

  getRun(runId: string, opts: { includeSuperseded?: boolean } & RequestOptions = {}): Promise<GetRunResponseJson> {
    const q = opts.includeSuperseded ? "?includeSuperseded=true" : "";
    return this.call("GET", `${runPath(runId)}${q}`, undefined, opts);
  }

  getRunAttempts(runId: string, options: RequestOptions = {}): Promise<GetRunAttemptsResponseJson> {
    return this.call("GET", `${runPath(runId)}/attempts`, undefined, options);
  }

  cancelRun(runId: string, reason = "", options: RequestOptions = {}): Promise<CancelRunResponseJson> {
    return this.call("POST", `${runPath(runId)}/cancel`, reason ? { reason } : {}, options);
  }

  retryRun(runId: string, options: RequestOptions = {}): Promise<RetryRunResponseJson> {
    return this.call("POST", `${runPath(runId)}/retry`, {}, options);
  }

  getPendingQuestion(runId: string, options: RequestOptions = {}): Promise<GetPendingQuestionResponseJson> {
    return this.call("GET", `${runPath(runId)}/pending-question`, undefined, options);
  }

  getPendingApproval(runId: string, options: RequestOptions = {}): Promise<GetPendingApprovalResponseJson> {
    return this.call("GET", `${runPath(runId)}/pending-approval`, undefined, options);
  }

  getPendingConnection(runId: string, options: RequestOptions = {}): Promise<GetPendingConnectionResponseJson> {
    return this.call("GET", `${runPath(runId)}/pending-connection`, undefined, options);
  }

  answerQuestion(runId: string, answers: AnswerQuestionRequestJson["answers"], options: RequestOptions = {}): Promise<AnswerQuestionResponseJson> {
    return this.call("POST", `${runPath(runId)}/answer`, { answers }, options);
  }

  decideApproval(runId: string, body: Omit<DecideApprovalRequestJson, "runId">, options: RequestOptions = {}): Promise<DecideApprovalResponseJson> {
    return this.call("POST", `${runPath(runId)}/decision`, body, options);
  }

  completeConnection(runId: string, body: Omit<CompleteConnectionRequestJson, "runId">, options: RequestOptions = {}): Promise<CompleteConnectionResponseJson> {
    return this.call("POST", `${runPath(runId)}/connection`, body, options);
  }

  addDocument(body: AddDocumentRequestJson, options: RequestOptions = {}): Promise<AddDocumentResponseJson> {
    return this.call("POST", "/v2/documents", body, options);
  }

  listDocuments(query: { pageSize?: number; pageToken?: string } = {}, options: RequestOptions = {}): Promise<ListDocumentsResponseJson> {
    const params = new URLSearchParams();
    if (query.pageSize) params.set("pageSize", String(query.pageSize));
    if (query.pageToken) params.set("pageToken", query.pageToken);
    const q = params.toString();
    return this.call("GET", `/v2/documents${q ? `?${q}` : ""}`, undefined, options);
  }

  removeDocument(documentId: string, options: RequestOptions = {}): Promise<RemoveDocumentResponseJson> {
    return this.call("DELETE", `/v2/documents/${encodeURIComponent(documentId)}`, undefined, options);
  }

  applyAgent(body: ApplyAgentRequestJson, options: RequestOptions = {}): Promise<ApplyAgentResponseJson> {
    return this.call("POST", "/v2/agents", body, options);
  }

  listAgents(options: RequestOptions = {}): Promise<ListAgentsResponseJson> {
    return this.call("GET", "/v2/agents", undefined, options);
  }

  getAgent(name: string, version?: number, options: RequestOptions = {}): Promise<GetAgentResponseJson> {
    const q = version === undefined ? "" : `?version=${version}`;
    return this.call("GET", `${agentPath(name)}${q}`, undefined, options);
  }

  listAgentVersions(name: string, options: RequestOptions = {}): Promise<ListAgentVersionsResponseJson> {
    return this.call("GET", `${agentPath(name)}/versions`, undefined, options);
  }

  /** Publishes version `toVersion` again; with `baseVersion`, only while that one is published (409 ABORTED). */
  rollbackAgent(name: string, toVersion: number, baseVersion?: number, options: RequestOptions = {}): Promise<RollbackAgentResponseJson> {
    const body = baseVersion === undefined ? { toVersion } : { toVersion, baseVersion };
    return this.call("POST", `${agentPath(name)}/rollback`, body, options);
  }

  setDefaultAgent(name: string, options: RequestOptions = {}): Promise<SetDefaultAgentResponseJson> {
    return this.call("POST", `${agentPath(name)}/default`, {}, options);
  }

  removeAgent(name: string, options: RequestOptions = {}): Promise<RemoveAgentResponseJson> {
    return this.call("DELETE", agentPath(name), undefined, options);
  }

  /** The tool catalog: the tools the workers announced, which an agent's `tools` may name. */
  listTools(options: RequestOptions = {}): Promise<ListToolsResponseJson> {
    return this.call("GET", "/v2/tools", undefined, options);
  }

  /** The request a worker would send first for a message, with no model call and no run. */
  renderAgent(name: string, body: Omit<RenderAgentRequestJson, "name">, options: RequestOptions = {}): Promise<RenderAgentResponseJson> {
    return this.call("POST", `${agentPath(name)}/render`, body, options);
  }

  /** Connects a channel; the answer carries the webhook URL to give the provider, never a secret. */
  addChannel(body: AddChannelRequestJson, options: RequestOptions = {}): Promise<AddChannelResponseJson> {
    return this.call("POST", "/v2/channels", body, options);
  }

  /** The tenant's channel connections: each secret as its name and last four characters. */
  listChannels(options: RequestOptions = {}): Promise<ListChannelsResponseJson> {
    return this.call("GET", "/v2/channels", undefined, options);
  }

  getChannel(channelId: string, options: RequestOptions = {}): Promise<GetChannelResponseJson> {
    return this.call("GET", channelPath(channelId), undefined, options);
  }

  removeChannel(channelId: string, options: RequestOptions = {}): Promise<RemoveChannelResponseJson> {
    return this.call("DELETE", channelPath(channelId), undefined, options);
  }

  /** Replaces the verification secret; the replaced one still verifies for `graceSeconds` (unset: 24 h). */
  rotateChannelSecret(channelId: string, secret: string, graceSeconds?: number, options: RequestOptions = {}): Promise<RotateChannelSecretResponseJson> {
    const body = graceSeconds === undefined ? { secret } : { secret, graceSeconds: String(graceSeconds) };
    return this.call("POST", `${channelPath(channelId)}/rotate-secret`, body, options);
  }

  /** Adds a schedule: each tick of its cron, in its timezone, starts a run of its agent. */
  addSchedule(body: AddScheduleRequestJson, options: RequestOptions = {}): Promise<AddScheduleResponseJson> {
    return this.call("POST", "/v2/schedules", body, options);
  }

  /** The tenant's schedules, each with its next fire time (unset while paused). */
  listSchedules(options: RequestOptions = {}): Promise<ListSchedulesResponseJson> {
    return this.call("GET", "/v2/schedules", undefined, options);
  }

  pauseSchedule(scheduleId: string, options: RequestOptions = {}): Promise<PauseScheduleResponseJson> {
    return this.call("POST", `${schedulePath(scheduleId)}/pause`, {}, options);
  }

  /** Resumes from the next tick after now: the ticks it was paused over are not caught up. */
  resumeSchedule(scheduleId: string, options: RequestOptions = {}): Promise<ResumeScheduleResponseJson> {
    return this.call("POST", `${schedulePath(scheduleId)}/resume`, {}, options);
  }

  removeSchedule(scheduleId: string, options: RequestOptions = {}): Promise<RemoveScheduleResponseJson> {
    return this.call("DELETE", schedulePath(scheduleId), undefined, options);
  }

  // ---- streams ----------------------------------------------------------------------------

  /**
   * A run's events: a snapshot on every (re)connect, then each durable event exactly once
   * (resumed from the cursor after a break), ephemeral deltas as they come, and the thin
   * interaction events resolved through the pending-* reads. Ends after a terminal event.
   */
  streamRun(runId: string, options: RunStreamOptions = {}): AsyncGenerator<RunStreamItem> {
    return runStream(this, runId, options);
  }

  /** A conversation's events across its runs, resumed from the cursor after a break. */
  streamConversation(conversationId: string, options: ConversationStreamOptions = {}): AsyncGenerator<ConversationStreamItem> {
    return conversationStream(this, conversationId, options);
  }

  /** The live run list: a page on every (re)connect, then each change of a run. */
  streamRuns(query: LiveRunsOptions = {}): AsyncGenerator<LiveRunsItem> {
    return liveRuns(this, query);
  }
}

/** The path of a run (identifiers are the caller's; they are escaped, never trusted). */
export function runPath(runId: string): string {
  return `/v2/runs/${encodeURIComponent(runId)}`;
}

/** The path of an agent (its name escaped: a name may hold `:` and `@`). */
export function channelPath(channelId: string): string {
  return `/v2/channels/${encodeURIComponent(channelId)}`;
}

export function schedulePath(scheduleId: string): string {
  return `/v2/schedules/${encodeURIComponent(scheduleId)}`;
}

export function agentPath(name: string): string {
  return `/v2/agents/${encodeURIComponent(name)}`;
}

export function listQuery(query: ListRunsQuery & { pageSize?: number }): string {
  const params = new URLSearchParams();
  for (const s of query.statuses ?? []) params.append("status", s);
  if (query.conversationId) params.set("conversationId", query.conversationId);
  if (query.pageSize) params.set("pageSize", String(query.pageSize));
  if (query.pageToken) params.set("pageToken", query.pageToken);
  if (query.createdAfter) params.set("createdAfter", query.createdAfter);
  if (query.treeRootRunId) params.set("treeRootRunId", query.treeRootRunId);
  const q = params.toString();
  return q ? `?${q}` : "";
}

export function isAbort(exc: unknown): boolean {
  return typeof exc === "object" && exc !== null && (exc as { name?: string }).name === "AbortError";
}

export type { RunJson };
