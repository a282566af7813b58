/**
 * The agents page's diff: two versions' normalised documents as indented JSON with sorted keys
 * (the lines `tether agents diff` compares), and a line diff between them.
 */

export type DiffLine = { kind: "same" | "added" | "removed"; text: string };

/** A normalised document as the lines a diff compares: one field or item a line, keys sorted. */
export function documentLines(normalised: string): string[] {
  return JSON.stringify(sortKeys(JSON.parse(normalised)), null, 2).split("\n");
}

function sortKeys(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(sortKeys);
  if (value === null || typeof value !== "object") return value;
  const sorted: Record<string, unknown> = {};
  for (const key of Object.keys(value).sort()) sorted[key] = sortKeys((value as Record<string, unknown>)[key]);
  return sorted;
}

/**
 * A shortest line diff from `before` to `after` (a longest common subsequence); removals come
 * before additions where a line was replaced, as a unified diff shows them.
 */
export function lineDiff(before: string[], after: string[]): DiffLine[] {
  // The common head and tail are most of two versions of a document: trimming them first keeps
  // the quadratic table to the changed middle.
  let head = 0;
  while (head < before.length && head < after.length && before[head] === after[head]) head++;
  let tail = 0;
  while (
    tail < before.length - head &&
    tail < after.length - head &&
    before[before.length - 1 - tail] === after[after.length - 1 - tail]
  ) tail++;
  const a = before.slice(head, before.length - tail);
  const b = after.slice(head, after.length - tail);
  const width = b.length + 1;
  // common[i * width + j]: the longest common subsequence of a[i:] and b[j:].
  const common = new Uint32Array((a.length + 1) * width);
  for (let i = a.length - 1; i >= 0; i--) {
    for (let j = b.length - 1; j >= 0; j--) {
      common[i * width + j] = a[i] === b[j]
        ? common[(i + 1) * width + j + 1]! + 1
        : Math.max(common[(i + 1) * width + j]!, common[i * width + j + 1]!);
    }
  }
  const out: DiffLine[] = before.slice(0, head).map((text) => ({ kind: "same", text }));
  let i = 0;
  let j = 0;
  while (i < a.length || j < b.length) {
    if (i < a.length && j < b.length && a[i] === b[j]) {
      out.push({ kind: "same", text: a[i]! });
      i++;
      j++;
    } else if (j >= b.length || (i < a.length && common[(i + 1) * width + j]! >= common[i * width + j + 1]!)) {
      out.push({ kind: "removed", text: a[i]! });
      i++;
    } else {
      out.push({ kind: "added", text: b[j]! });
      j++;
    }
  }
  for (const text of before.slice(before.length - tail)) out.push({ kind: "same", text });
  return out;
}

/** Whether a diff changes anything. */
export function changed(diff: DiffLine[]): boolean {
  return diff.some((line) => line.kind !== "same");
}
