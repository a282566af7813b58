/**
 * The bridge's errors: `{"error": {"status": "NOT_FOUND", "code": "not_found", "message": "..."}}`
 * with the HTTP status of the gRPC code; a stream's `event: error` frame carries `resume` beside
 * `error` (docs/bridge-v2.md).
 */

export interface ErrorBodyJson {
  error?: { status?: string; code?: string | number; message?: string; resume?: string };
  resume?: string;
}

export class TetherError extends Error {
  /** The HTTP status (0 when the request never got an answer). */
  readonly httpStatus: number;
  /** The gRPC status name the body carried ("NOT_FOUND"), or a local one ("NETWORK"). */
  readonly status: string;
  /** The body's stable snake_case reason ("not_found", "csrf_required"). */
  readonly code: string;
  /** Where a stream that ended early can resume, when it said. */
  readonly resume?: string;

  constructor(
    httpStatus: number,
    status: string,
    code: string,
    message: string,
    resume?: string,
  ) {
    super(message);
    this.name = "TetherError";
    this.httpStatus = httpStatus;
    this.status = status;
    this.code = code;
    if (resume !== undefined) this.resume = resume;
  }

  /** Whether a stream should reconnect after this error rather than give up. */
  get retryable(): boolean {
    if (this.httpStatus === 0) return true;
    return RETRYABLE.has(this.status);
  }

  /** A parsed error body (a response's or an `event: error` frame's). */
  static fromBody(httpStatus: number, body: unknown): TetherError {
    const b = (body ?? {}) as ErrorBodyJson;
    const e = b.error;
    if (e && typeof e === "object") {
      const status = typeof e.status === "string" ? e.status : statusName(httpStatus);
      const code = e.code === undefined ? status.toLowerCase() : String(e.code);
      const message = typeof e.message === "string" ? e.message : status;
      const resume = b.resume ?? e.resume;
      return new TetherError(httpStatus || httpOf(status), status, code, message, resume);
    }
    const status = statusName(httpStatus);
    return new TetherError(httpStatus, status, status.toLowerCase(), `HTTP ${httpStatus}`);
  }

  /** An error response; a body that is not the JSON error shape still gives a TetherError. */
  static async fromResponse(response: Response): Promise<TetherError> {
    let body: unknown = undefined;
    try {
      body = JSON.parse(await response.text());
    } catch {
      body = undefined;
    }
    return TetherError.fromBody(response.status, body);
  }
}

const RETRYABLE = new Set([
  "UNAVAILABLE",
  "RESOURCE_EXHAUSTED",
  "ABORTED",
  "DEADLINE_EXCEEDED",
  "INTERNAL",
  "UNKNOWN",
  "CANCELLED",
  "NETWORK",
]);

/** The HTTP status of a gRPC status name (for an error that came in a stream's frame). */
function httpOf(status: string): number {
  const map: Record<string, number> = {
    INVALID_ARGUMENT: 400, OUT_OF_RANGE: 400, UNAUTHENTICATED: 401, PERMISSION_DENIED: 403,
    NOT_FOUND: 404, ALREADY_EXISTS: 409, ABORTED: 409, FAILED_PRECONDITION: 412,
    RESOURCE_EXHAUSTED: 429, CANCELLED: 499, UNIMPLEMENTED: 501, UNAVAILABLE: 503,
    DEADLINE_EXCEEDED: 504,
  };
  return map[status] ?? 500;
}

function statusName(httpStatus: number): string {
  switch (httpStatus) {
    case 400:
      return "INVALID_ARGUMENT";
    case 401:
      return "UNAUTHENTICATED";
    case 403:
      return "PERMISSION_DENIED";
    case 404:
      return "NOT_FOUND";
    case 409:
      return "ABORTED";
    case 412:
      return "FAILED_PRECONDITION";
    case 429:
      return "RESOURCE_EXHAUSTED";
    case 499:
      return "CANCELLED";
    case 501:
      return "UNIMPLEMENTED";
    case 503:
      return "UNAVAILABLE";
    case 504:
      return "DEADLINE_EXCEEDED";
    default:
      return httpStatus >= 500 ? "INTERNAL" : "UNKNOWN";
  }
}
