"""The README's pictures of the web explorer, made by the explorer itself.

Run: ``.venv/bin/python docs/explorer_pictures.py`` (needs the ``dev`` extra and the OS's
Chromium and chromedriver, which ``.ci/run`` installs). It records the demo model into a
temporary store (the three runs of ``tracelake demo --store``, and a fourth whose head
was changed, to compare with), serves it with ``tracelake.explorer.running``, opens the
pages in headless Chromium and writes ``docs/images/explorer-*.png``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import chromium  # noqa: E402  (tests/browser.py: the tests' browser set-up)
from selenium.webdriver.common.by import By  # noqa: E402

import tracelake as tl  # noqa: E402
from tracelake.demo import DemoNet, demo_inputs  # noqa: E402
from tracelake.explorer import running  # noqa: E402

PROMPTS = {"base": "Paris is the capital of", "other": "Rome is the capital of"}


def record(path: Path) -> tl.Store:
    store = tl.open(path)
    model = DemoNet().eval()
    with torch.no_grad():
        for i, (name, prompt) in enumerate(PROMPTS.items()):
            torch.manual_seed(i)
            ids = (demo_inputs() + 7 * i) % 50
            store.record(model, ids, name=name, meta={"prompt": prompt, "lr": 1e-3})
        model.head.weight[0] *= 1.1
        store.record(
            model, demo_inputs(), name="head-scaled", meta={"prompt": PROMPTS["base"], "lr": 1e-3}
        )
    return store


def main() -> None:
    out = ROOT / "docs" / "images"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = record(Path(tmp) / "demo.tl")
        # the demo's ReLU, by its function: labels follow TorchLens's numbering
        [relu] = store.query("select label from ops where run = 'base' and func = 'relu'").tensors(
            "label"
        )
        driver = chromium(1200, 760)
        try:
            with running(store) as url:
                pages = {
                    "runs": "/",
                    "run": "/run?run=base&where=func+in+('linear',+'relu')+and+absmax+>+1",
                    "op": f"/op?run=base&label={relu}",
                    "graph": "/graph?run=base",
                    "compare": "/compare?a=base&b=head-scaled",
                }
                for name, page in pages.items():
                    driver.get(url + page)
                    driver.find_element(By.ID, "timing")  # the page is complete
                    target = out / f"explorer-{name}.png"
                    driver.save_screenshot(str(target))
                    print(f"wrote {target.relative_to(ROOT)}")
        finally:
            driver.quit()
            store.close()


if __name__ == "__main__":
    main()
