import { describe, expect, it } from "vitest";
import { initialRunState, partText, reduceRun, type RunEventJson, type RunState } from "../src/index.js";

const ev = (e: RunEventJson) => ({ kind: "event" as const, event: e });
const delta = (text: string, offset: number) => ev({ type: "text.delta", textDelta: { text, ...(offset ? { offset: String(offset) } : {}) } });

function fold(items: Parameters<typeof reduceRun>[1][], from: RunState = initialRunState): RunState {
  return items.reduce(reduceRun, from);
}

describe("reduceRun", () => {
  it("appends deltas at their offset, ignores repeats, replaces parts by index", () => {
    const s = fold([
      { kind: "snapshot", run: { runId: "r", status: "RUN_STATUS_RUNNING" }, parts: [], resumed: false },
      ev({ seq: "1", type: "part.added", partAdded: { part: { role: "assistant", text: {} } } }),
      delta("héllo ", 0),
      delta("héllo ", 0), // a repeat: ignored
      delta("world", 7), // 7 bytes: "héllo " in UTF-8
      ev({ seq: "2", type: "part.updated", partUpdated: { part: { role: "assistant", final: true, text: { text: "héllo world!" } } } }),
      ev({ seq: "2", type: "part.updated", partUpdated: { part: { role: "assistant", text: { text: "stale" } } } }), // seq seen
    ]);
    expect(s.parts).toEqual([{ role: "assistant", final: true, text: { text: "héllo world!" } }]);
    expect(s.lastSeq).toBe(2);
    expect(s.events.map((e) => e.seq)).toEqual([1, 2]);
  });

  it("shows a stream joined mid-part as a marked tail until the part's checkpoint", () => {
    let s = fold([
      { kind: "snapshot", run: { runId: "r", status: "RUN_STATUS_RUNNING" }, parts: [{ role: "assistant", text: {} }], resumed: false },
      delta("three ", 20),
      delta("four ", 26),
      delta("lost? ", 40), // not contiguous with the tail: dropped
    ]);
    expect(partText(s, s.parts[0]!)).toBe("… three four ");
    s = reduceRun(s, ev({ seq: "4", type: "part.updated", partUpdated: { part: { role: "assistant", text: { text: "one two xx three four five " } } } }));
    expect(s.tails).toEqual({});
    expect(partText(s, s.parts[0]!)).toBe("one two xx three four five ");
  });

  it("keeps live text it is ahead with across a reconnect's snapshot, not a final one", () => {
    let s = fold([
      { kind: "snapshot", run: { runId: "r" }, parts: [{ role: "assistant", text: {} }], resumed: false },
      delta("one ", 0),
      delta("two ", 4),
    ]);
    s = reduceRun(s, { kind: "snapshot", run: { runId: "r" }, parts: [{ role: "assistant", text: { text: "one " } }], resumed: true });
    s = reduceRun(s, delta("three", 8));
    expect(partText(s, s.parts[0]!)).toBe("one two three");
    s = reduceRun(s, { kind: "snapshot", run: { runId: "r" }, parts: [{ role: "assistant", final: true, text: { text: "one" } }], resumed: true });
    expect(partText(s, s.parts[0]!)).toBe("one");
  });

  it("shows a channel run's delivery outcome, reported before run.completed", () => {
    const s = fold([
      { kind: "snapshot", run: { runId: "r", status: "RUN_STATUS_RUNNING" }, parts: [], resumed: false },
      ev({
        seq: "1",
        type: "delivery.failed",
        deliveryFailed: { deliveryId: "dlv_1", channelId: "ch_1", kind: "slack", error: { code: "delivery_refused", message: "channel_not_found" } },
      }),
      ev({ seq: "2", type: "run.completed", runCompleted: { resultText: "hi" } }),
    ]);
    expect(s.run?.delivery).toEqual({
      state: "failed",
      deliveryId: "dlv_1",
      channelId: "ch_1",
      kind: "slack",
      error: { code: "delivery_refused", message: "channel_not_found" },
    });
    expect(s.run?.status).toBe("RUN_STATUS_COMPLETED");
  });

  it("tracks retry-pending, the pending interaction and the terminal status", () => {
    const s = fold([
      { kind: "snapshot", run: { runId: "r", status: "RUN_STATUS_RUNNING", attempt: 1, maxAttempts: 3 }, parts: [], resumed: false },
      ev({ seq: "3", type: "run.retry-pending", runRetryPending: { attempt: 1, maxAttempts: 3, nextAttemptAt: "2026-12-03T10:00:05Z", error: { code: "provider_overloaded" } } }),
    ]);
    expect(s.run?.status).toBe("RUN_STATUS_RETRY_PENDING");
    expect(s.retry).toEqual({ attempt: 1, maxAttempts: 3, nextAttemptAt: "2026-12-03T10:00:05Z", error: { code: "provider_overloaded" } });
    const started = reduceRun(s, ev({ seq: "4", type: "run.started", runStarted: { attempt: 2 } }));
    expect([started.retry, started.run?.attempt, started.run?.status]).toEqual([null, 2, "RUN_STATUS_RUNNING"]);
    const q = { interactionId: "i", questions: [] };
    const waiting = reduceRun(started, { kind: "event", event: { seq: "5", type: "question.requested" }, pending: { type: "question", question: q } });
    expect([waiting.run?.status, waiting.pending]).toEqual(["RUN_STATUS_WAITING_FOR_QUESTION", { type: "question", question: q }]);
    const answered = reduceRun(waiting, ev({ seq: "6", type: "question.answered" }));
    expect(answered.pending).toBeNull();
    const done = reduceRun(answered, ev({ seq: "7", type: "run.completed", runCompleted: { resultText: "ok" } }));
    expect([done.run?.status, done.run?.resultText]).toEqual(["RUN_STATUS_COMPLETED", "ok"]);
  });
  it("tracks a run parked on its timer and woken", () => {
    const s = fold([
      { kind: "snapshot", run: { runId: "r", status: "RUN_STATUS_RUNNING", attempt: 1, maxAttempts: 3 }, parts: [], resumed: false },
      ev({ seq: "4", type: "timer.set", timerSet: { toolCallId: "toolu_1", dueAt: "2026-12-05T10:00:00Z" } }),
    ]);
    expect([s.run?.status, s.run?.nextWakeAt, s.pending]).toEqual(["RUN_STATUS_WAITING_FOR_TIMER", "2026-12-05T10:00:00Z", null]);
    const fired = reduceRun(s, ev({ seq: "5", type: "timer.fired", timerFired: { dueAt: "2026-12-05T10:00:00Z" } }));
    const queued = reduceRun(fired, ev({ seq: "6", type: "run.queued", runQueued: { reason: "timer" } }));
    expect([queued.run?.status, queued.run?.nextWakeAt]).toEqual(["RUN_STATUS_QUEUED", undefined]);
  });
});
