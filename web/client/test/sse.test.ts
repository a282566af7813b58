import { describe, expect, it } from "vitest";
import { SseParser, readSse, type SseFrame } from "../src/sse.js";

function parseAll(chunks: string[]): SseFrame[] {
  const parser = new SseParser();
  const frames: SseFrame[] = [];
  for (const chunk of chunks) frames.push(...parser.push(chunk));
  parser.end();
  return frames;
}

const STREAM =
  "retry: 2000\nid: 1\nevent: snapshot\ndata: {\"a\":1}\n\n" +
  ": keepalive comment\n\n" +
  "id: 2\r\nevent: part.added\r\ndata: line one\r\ndata: line two\r\n\r\n" +
  "event: text.delta\rdata:no-space\r\r" +
  "data: only data\n\n";

const EXPECTED = [
  { event: "snapshot", data: '{"a":1}', id: "1", hasId: true, retry: 2000 },
  { event: "part.added", data: "line one\nline two", id: "2", hasId: true },
  { event: "text.delta", data: "no-space", id: "2", hasId: false },
  { event: "message", data: "only data", id: "2", hasId: false },
];

describe("SseParser", () => {
  it("parses frames: fields, multi-line data, comments, every line ending", () => {
    expect(parseAll([STREAM])).toEqual(EXPECTED);
  });

  it("gives the same frames however the text is split", () => {
    for (let i = 0; i <= STREAM.length; i++) {
      expect(parseAll([STREAM.slice(0, i), STREAM.slice(i)])).toEqual(EXPECTED);
    }
    // One character at a time.
    expect(parseAll([...STREAM])).toEqual(EXPECTED);
  });

  it("does not dispatch an unfinished frame when the stream ends", () => {
    expect(parseAll(["data: complete\n\ndata: cut off"])).toEqual([
      { event: "message", data: "complete", id: "", hasId: false },
    ]);
  });

  it("keeps an empty data line and strips one leading BOM", () => {
    expect(parseAll(["\ufeffdata:\ndata: x\n\n"])).toEqual([
      { event: "message", data: "\nx", id: "", hasId: false },
    ]);
  });

  it("ignores an id with NUL and a frame of no data", () => {
    expect(parseAll(["id: 5\n\nid: a\0b\ndata: d\n\n"])).toEqual([
      { event: "message", data: "d", id: "5", hasId: false },
    ]);
  });

  it("decodes bytes split inside a multi-byte character", async () => {
    const bytes = new TextEncoder().encode("data: héllo ✓\n\n");
    const stream = new ReadableStream<Uint8Array>({
      start(c) {
        for (const b of bytes) c.enqueue(new Uint8Array([b]));
        c.close();
      },
    });
    const frames: SseFrame[] = [];
    for await (const f of readSse(stream)) frames.push(f);
    expect(frames.map((f) => f.data)).toEqual(["héllo ✓"]);
  });
});
