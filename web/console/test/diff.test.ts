import { describe, expect, it } from "vitest";
import { changed, documentLines, lineDiff } from "../src/diff.js";

const text = (lines: ReturnType<typeof lineDiff>) =>
  lines.map((l) => `${l.kind === "added" ? "+" : l.kind === "removed" ? "-" : " "}${l.text}`);

describe("documentLines", () => {
  it("indents and sorts keys at every depth, as tether agents diff does", () => {
    expect(documentLines('{"tools":["b","a"],"name":"x","limits":{"max_steps":5,"max_attempts":2}}')).toEqual([
      "{",
      '  "limits": {',
      '    "max_attempts": 2,',
      '    "max_steps": 5',
      "  },",
      '  "name": "x",',
      '  "tools": [',
      '    "b",',
      '    "a"',
      "  ]",
      "}",
    ]);
  });
});

describe("lineDiff", () => {
  it("shows a replaced line as its removal then its addition, the rest unchanged", () => {
    const before = documentLines('{"name":"helper","instructions":"You are Helper.","model":"m"}');
    const after = documentLines('{"name":"helper","instructions":"You are Helper v2.","model":"m"}');
    expect(text(lineDiff(before, after))).toEqual([
      " {",
      '-  "instructions": "You are Helper.",',
      '+  "instructions": "You are Helper v2.",',
      '   "model": "m",',
      '   "name": "helper"',
      " }",
    ]);
  });

  it("finds insertions and removals in the middle, and keeps both sides' lines in order", () => {
    const diff = lineDiff(["a", "b", "c", "d", "e"], ["a", "c", "x", "d", "e", "f"]);
    expect(text(diff)).toEqual([" a", "-b", " c", "+x", " d", " e", "+f"]);
    expect(diff.filter((l) => l.kind !== "added").map((l) => l.text)).toEqual(["a", "b", "c", "d", "e"]);
    expect(diff.filter((l) => l.kind !== "removed").map((l) => l.text)).toEqual(["a", "c", "x", "d", "e", "f"]);
  });

  it("is the shortest diff: a moved block costs only its lines, not everything after it", () => {
    const diff = lineDiff(["1", "2", "3", "4", "5", "6"], ["4", "5", "6", "1", "2", "3"]);
    expect(diff.filter((l) => l.kind !== "same")).toHaveLength(6);
  });

  it("says whether anything changed", () => {
    expect(changed(lineDiff(["a", "b"], ["a", "b"]))).toBe(false);
    expect(changed(lineDiff([], ["a"]))).toBe(true);
    expect(text(lineDiff(["a"], []))).toEqual(["-a"]);
  });
});
