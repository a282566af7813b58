// The browser side's packages as an app would install them: `make packages` compiles
// @tether/client and @tether/react to JavaScript with type declarations and packs each with
// `npm pack` into build/web/packages/, ready for `npm publish <tarball>`.
//
// The workspace's own package.json files point at the TypeScript sources, which the console,
// the examples and Vitest use as they are; each packed package.json is derived from its source
// one, pointing at dist/ instead. Nothing is fetched and nothing is published from here.
import { execFileSync } from "node:child_process";
import { cpSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const build = join(root, "build", "web");
const packages = join(build, "packages");
const tsc = join(root, "node_modules", ".bin", "tsc");
// Dependencies first: @tether/react's declarations name @tether/client's.
const names = ["client", "react"];

rmSync(build, { recursive: true, force: true });
mkdirSync(packages, { recursive: true });

for (const name of names) {
  const source = join(root, "web", name);
  const staged = join(build, name);
  execFileSync(tsc, ["-p", join(source, "tsconfig.build.json"), "--outDir", join(staged, "dist")], {
    stdio: "inherit",
  });
  const manifest = JSON.parse(readFileSync(join(source, "package.json"), "utf8"));
  delete manifest.private; // kept on the source package, which must never be published as is
  Object.assign(manifest, {
    main: "./dist/index.js",
    types: "./dist/index.d.ts",
    exports: { ".": { types: "./dist/index.d.ts", default: "./dist/index.js" } },
    files: ["dist"],
    sideEffects: false,
  });
  writeFileSync(join(staged, "package.json"), `${JSON.stringify(manifest, null, 2)}\n`);
  cpSync(join(source, "README.md"), join(staged, "README.md"));
  const packed = execFileSync("npm", ["pack", "--silent", "--pack-destination", packages], {
    cwd: staged,
    encoding: "utf8",
  }).trim();
  console.log(join(packages, packed));
}
