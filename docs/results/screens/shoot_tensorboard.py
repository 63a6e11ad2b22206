"""The geometry scalars next to the loss in TensorBoard, shot in headless Chromium (the README's picture).

    python docs/results/screens/shoot_tensorboard.py [OUT_DIR]

Trains a tiny GPT-2 for 60 steps with the Hugging Face Trainer, report_to=["tensorboard"] and
qkgeom's QKGeometryCallback (nothing else configured), serves the Trainer's log folder with
TensorBoard on loopback, and saves trainer-tensorboard.png here once the qkgeom/ charts are drawn.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from qkgeom.integrations.transformers import QKGeometryCallback

VOCAB, T, B = 40, 32, 8


def train(out: Path) -> Path:
    """A tiny Trainer run logging to TensorBoard; returns its log folder."""
    logs = out / "tb"
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(logs)
    data = torch.randint(0, VOCAB, (256, T), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=64, n_layer=2, n_head=4))
    args = TrainingArguments(
        str(out / "hf"), max_steps=60, per_device_train_batch_size=B, learning_rate=3e-3, logging_steps=5,
        save_strategy="no", report_to=["tensorboard"], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    callback = QKGeometryCallback(data[:4], out / "run", every=10)
    Trainer(model, args, train_dataset=[{"input_ids": b, "labels": b} for b in data], callbacks=[callback]).train()
    return logs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: Path) -> int:
    logs = train(out)
    port = free_port()
    board = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logs), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
              "--disable-background-networking", "--disable-component-update", "--no-first-run"):  # fmt: skip
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        time.sleep(4)  # TensorBoard reads the event files
        driver.get(f"http://127.0.0.1:{port}/?darkMode=false#timeseries&tagFilter=qkgeom%2F%7Ctrain%2Floss")
        for _ in range(60):  # until the qkgeom charts are drawn
            n = driver.execute_script("return document.querySelectorAll('card-view, scalar-card').length")
            if n >= 8:
                break
            time.sleep(1)
        driver.execute_script(  # the settings pane opens by default: close it, the charts get the room
            "for (const b of document.querySelectorAll('button')) {"
            " if ((b.getAttribute('aria-label') || '').toLowerCase().includes('close')) b.click(); }"
        )
        time.sleep(3)
        path = Path(__file__).parent / "trainer-tensorboard.png"
        driver.save_screenshot(str(path))
        print(f"{path}: {n} scalar cards")
        return 0 if n >= 8 else 1
    finally:
        driver.quit()
        board.terminate()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="qkgeom-tb-"))))
