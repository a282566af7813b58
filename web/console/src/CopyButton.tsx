import { useState } from "react";

/** Copies `text` to the clipboard and says whether it did (a page without clipboard access says so). */
export function CopyButton({ text, label }: { text: string; label: string }) {
  const [said, setSaid] = useState("");
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(text);
      setSaid("Copied");
    } catch {
      setSaid("Could not copy: select the URL and copy it");
    }
  };
  return (
    <span className="copy">
      <button type="button" className="quiet" aria-label={label} onClick={() => void copy()}>Copy</button>
      <span role="status" className="hint">{said}</span>
    </span>
  );
}
