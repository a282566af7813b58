"""The browser side's packages as an app installs them: `make packages` (scripts/pack_web.mjs)
packs @tether/client and @tether/react; unpacked into a fresh project beside their dependencies,
they load in plain Node (no bundler, no workspace, no TypeScript sources) and type-check an
app's code under Node's own module resolution with the declarations checked too."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = ROOT / "node_modules"  # `make test` installs the workspace first

# What the app's project has besides the two packages: their dependencies, and TypeScript's
# view of React for its own code.
BESIDE = ["@bufbuild/protobuf", "react", "@types/react"]

SMOKE = """
import { TetherClient, TetherError, reduceRun, initialRunState } from "@tether/client";
import { TetherProvider, useRun, QuestionCard } from "@tether/react";

const seen = [];
const client = new TetherClient({
  baseUrl: "https://tether.example.com",
  auth: { type: "bearer", token: "tt_test" },
  fetch: async (url, init) => {
    seen.push([String(url), init.method, init.headers.Authorization]);
    if (seen.length === 1) {
      return Response.json({ run: { runId: "run_1", status: "RUN_STATUS_QUEUED" } });
    }
    return Response.json(
      { error: { code: "run_not_found", status: "NOT_FOUND", message: "run 'run_2' not found" } },
      { status: 404 },
    );
  },
});
const sent = await client.sendMessage({ text: "hello" });
let refused;
try { await client.getRun("run_2"); } catch (exc) { refused = exc; }
const snapshot = { kind: "snapshot", run: sent.run, parts: [], resumed: false };
const state = reduceRun(initialRunState, snapshot);
console.log(JSON.stringify({
  seen,
  status: state.run.status,
  refused: refused instanceof TetherError
    ? [refused.httpStatus, refused.status, refused.code]
    : String(refused),
  react: [typeof TetherProvider, typeof useRun, typeof QuestionCard],
}));
"""

APP = """
import { TetherClient, type RunJson, type SendMessageRequestJson } from "@tether/client";
import { TetherProvider, useRun } from "@tether/react";

const client = new TetherClient({ auth: { type: "session" } });
const body: SendMessageRequestJson = { text: "hello", conversationId: "c-1" };

export async function send(): Promise<RunJson | undefined> {
  return (await client.sendMessage(body)).run;
}

function Status({ runId }: { runId: string }) {
  const { state, error } = useRun(runId);
  return <p>{error ? error.code : state.run?.status}</p>;
}

export const App = ({ runId }: { runId: string }) => (
  <TetherProvider client={client}>
    <Status runId={runId} />
  </TetherProvider>
);
"""

TSCONFIG = {
    "compilerOptions": {
        "strict": True,
        "module": "node16",
        "moduleResolution": "node16",
        "target": "ES2022",
        "lib": ["ES2022", "DOM", "DOM.Iterable"],
        "jsx": "react-jsx",
        "noEmit": True,
        "skipLibCheck": False,
        "types": [],
    },
    "include": ["app.tsx"],
}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh project with the packed packages installed and their dependencies beside."""
    packed = subprocess.run(
        ["node", str(ROOT / "scripts" / "pack_web.mjs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    project = tmp_path_factory.mktemp("app")
    (project / "package.json").write_text(json.dumps({"name": "app", "type": "module"}))
    for tarball in packed:
        with tarfile.open(tarball) as archive:
            name = json.load(archive.extractfile("package/package.json"))["name"]  # type: ignore[arg-type]
            target = project / "node_modules" / name
            for member in archive.getmembers():
                member.name = member.name.removeprefix("package/")
            archive.extractall(target, filter="data")
    for name in BESIDE:
        link = project / "node_modules" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(MODULES / name)
    return project


def test_the_packed_packages_hold_only_javascript_declarations_and_their_readme(
    app: Path,
) -> None:
    for name in ("client", "react"):
        installed = app / "node_modules" / "@tether" / name
        files = {p.relative_to(installed).as_posix() for p in installed.rglob("*") if p.is_file()}
        assert {"package.json", "README.md", "dist/index.js", "dist/index.d.ts"} <= files
        assert not [f for f in files if f.endswith((".ts", ".tsx")) and not f.endswith(".d.ts")]
        manifest = json.loads((installed / "package.json").read_text())
        assert "private" not in manifest, "publishable"
        assert manifest["exports"]["."]["default"] == "./dist/index.js"


def test_an_app_loads_them_in_plain_node(app: Path) -> None:
    ran = subprocess.run(
        ["node", "--input-type=module", "-e", SMOKE],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == {
        "seen": [
            ["https://tether.example.com/v2/messages", "POST", "Bearer tt_test"],
            ["https://tether.example.com/v2/runs/run_2", "GET", "Bearer tt_test"],
        ],
        "status": "RUN_STATUS_QUEUED",
        "refused": [404, "NOT_FOUND", "run_not_found"],
        "react": ["function", "function", "function"],
    }


def test_an_apps_code_type_checks_against_their_declarations(app: Path) -> None:
    (app / "tsconfig.json").write_text(json.dumps(TSCONFIG))
    checked = type_check(app, APP)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The check is real: a wrong field in a request body is refused.
    wrong = type_check(app, APP.replace('conversationId: "c-1"', 'conversation: "c-1"'))
    assert wrong.returncode != 0 and "conversation" in wrong.stdout


def type_check(app: Path, code: str) -> subprocess.CompletedProcess[str]:
    """tsc over the app's project with `code` as its source."""
    (app / "app.tsx").write_text(code)
    return subprocess.run(
        [str(MODULES / ".bin" / "tsc"), "-p", "tsconfig.json"],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=120,
    )
