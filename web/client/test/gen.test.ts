import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { afterAll, describe, expect, it } from "vitest";

// The checked-in types (web/client/src/gen) are what a fresh `buf generate` gives from the
// protos, so the client's JSON bodies cannot drift from the gateway's messages.
const ROOT = join(import.meta.dirname, "..", "..", "..");
const GEN = join(ROOT, "web", "client", "src", "gen");

function files(dir: string): Map<string, string> {
  const out = new Map<string, string>();
  const walk = (d: string) => {
    for (const name of readdirSync(d)) {
      const p = join(d, name);
      if (statSync(p).isDirectory()) walk(p);
      else out.set(relative(dir, p), readFileSync(p, "utf8"));
    }
  };
  walk(dir);
  return out;
}

describe("generated types", () => {
  const out = mkdtempSync(join(tmpdir(), "tether-gen-"));
  afterAll(() => rmSync(out, { recursive: true, force: true }));

  it("match a fresh generation from the protos (run `make gen` when this fails)", () => {
    execFileSync(join(ROOT, "node_modules", ".bin", "buf"), ["generate", "--template", "buf.gen.ts.yaml", "-o", out], { cwd: ROOT });
    const fresh = files(join(out, "web", "client", "src", "gen"));
    const checkedIn = files(GEN);
    expect([...checkedIn.keys()].sort()).toEqual([...fresh.keys()].sort());
    for (const [name, text] of fresh) {
      expect(checkedIn.get(name), `${name} is stale`).toBe(text);
    }
  });
});
