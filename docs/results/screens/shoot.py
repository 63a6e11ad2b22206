"""Full-page screenshots of rendered reports in headless Chromium (the screenshots in this folder).

    python docs/results/screens/shoot.py NAME=path/to/report/index.html [...]

A NAME ending in `-top` is the first screen only (1280 x 900); any other is the whole page.

Each page is checked as it is shot: every image loaded, and no horizontal overflow at 1280 px.
"""

import shutil
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def main(pairs: list[str]) -> int:
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    bad = 0
    try:
        for pair in pairs:
            name, path = pair.split("=", 1)
            driver.get(Path(path).resolve().as_uri())
            images = driver.execute_script("return Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
            overflow = driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            height = driver.execute_script("return document.documentElement.scrollHeight")
            ok = all(c and w > 100 for c, w in images) and overflow <= 0
            bad += not ok
            verdict = "ok" if ok else "FAIL"
            print(f"{name}: {len(images)} images loaded, overflow {overflow} px, height {height} px: {verdict}")
            if not name.endswith("-top"):  # NAME-top: the first screen only (1280 x 900), as a reader lands
                driver.set_window_size(1280, min(height + 100, 6000))
            driver.save_screenshot(str(Path(__file__).parent / f"{name}.png"))
            driver.set_window_size(1280, 900)
    finally:
        driver.quit()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
