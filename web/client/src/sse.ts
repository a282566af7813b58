/**
 * A server-sent events parser (the WHATWG event-stream rules), fed text as it arrives.
 *
 * Chunks may split anywhere: inside a field, between `\r` and `\n`, inside a multi-byte
 * character (the reader decodes with a streaming TextDecoder before it gets here).
 */

/** One dispatched event. */
export interface SseFrame {
  /** The `event:` field, "message" when absent. */
  event: string;
  /** The `data:` lines joined with "\n". */
  data: string;
  /** The last `id:` seen so far on this stream (the spec's "last event ID"), "" when none. */
  id: string;
  /** Whether this frame itself carried an `id:` field. */
  hasId: boolean;
  /** The `retry:` the server asked for, when this frame carried one. */
  retry?: number;
}

export class SseParser {
  private buffer = "";
  private sawCR = false;
  private started = false;
  private eventType = "";
  private dataLines: string[] = [];
  private hasData = false;
  private lastId = "";
  private frameHasId = false;
  private retry: number | undefined;

  /** Feeds decoded text; returns the frames it completed. */
  push(text: string): SseFrame[] {
    if (!this.started && text.length > 0) {
      this.started = true;
      if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
    }
    const frames: SseFrame[] = [];
    let start = 0;
    for (let i = 0; i < text.length; i++) {
      const c = text.charCodeAt(i);
      if (c === 10 /* \n */) {
        if (this.sawCR && i === 0 && this.buffer === "") {
          // The \n of a \r\n split across chunks: the line ended already.
          this.sawCR = false;
          start = 1;
          continue;
        }
        this.sawCR = false;
        this.line(this.buffer + text.slice(start, i), frames);
        this.buffer = "";
        start = i + 1;
      } else if (c === 13 /* \r */) {
        this.line(this.buffer + text.slice(start, i), frames);
        this.buffer = "";
        if (i + 1 < text.length && text.charCodeAt(i + 1) === 10) i++;
        else if (i + 1 === text.length) this.sawCR = true;
        start = i + 1;
      } else if (this.sawCR) {
        this.sawCR = false;
      }
    }
    this.buffer += text.slice(start);
    return frames;
  }

  /** The stream ended: an incomplete frame is discarded, as the spec says. */
  end(): SseFrame[] {
    this.buffer = "";
    this.resetFrame();
    return [];
  }

  /** The last event ID (what a reconnect sends as Last-Event-ID). */
  get lastEventId(): string {
    return this.lastId;
  }

  private line(line: string, frames: SseFrame[]): void {
    if (line === "") {
      this.dispatch(frames);
      return;
    }
    if (line.charCodeAt(0) === 58 /* : */) return; // a comment (keepalive)
    const colon = line.indexOf(":");
    let field: string;
    let value: string;
    if (colon === -1) {
      field = line;
      value = "";
    } else {
      field = line.slice(0, colon);
      value = line.slice(colon + 1);
      if (value.charCodeAt(0) === 32) value = value.slice(1);
    }
    switch (field) {
      case "event":
        this.eventType = value;
        break;
      case "data":
        this.dataLines.push(value);
        this.hasData = true;
        break;
      case "id":
        if (!value.includes("\0")) {
          this.lastId = value;
          this.frameHasId = true;
        }
        break;
      case "retry":
        if (/^\d+$/.test(value)) this.retry = Number(value);
        break;
      default:
        break; // unknown fields are ignored
    }
  }

  private dispatch(frames: SseFrame[]): void {
    if (this.hasData) {
      const frame: SseFrame = {
        event: this.eventType || "message",
        data: this.dataLines.join("\n"),
        id: this.lastId,
        hasId: this.frameHasId,
      };
      if (this.retry !== undefined) frame.retry = this.retry;
      frames.push(frame);
    }
    this.resetFrame();
  }

  private resetFrame(): void {
    this.eventType = "";
    this.dataLines = [];
    this.hasData = false;
    this.frameHasId = false;
    this.retry = undefined;
  }
}

/** The frames of a response body, as they arrive. */
export async function* readSse(body: ReadableStream<Uint8Array>): AsyncGenerator<SseFrame> {
  const reader = body.getReader();
  const decoder = new TextDecoder("utf-8");
  const parser = new SseParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        const tail = decoder.decode();
        if (tail) yield* parser.push(tail);
        parser.end();
        return;
      }
      yield* parser.push(decoder.decode(value, { stream: true }));
    }
  } finally {
    // Leaving early (a consumer stopped, an abort): release the connection.
    await reader.cancel().catch(() => undefined);
  }
}
