const chromium = require('@sparticuz/chromium'); const C = chromium.default || chromium;
const puppeteer = require('puppeteer-core');
(async () => {
  const browser = await puppeteer.launch({
    args: [...C.args, '--no-sandbox'],
    executablePath: await C.executablePath(),
    headless: true,
    defaultViewport: { width: 1600, height: 900 },
  });
  const page = await browser.newPage();
  page.on('console', m => console.log('console:', m.text().slice(0, 200)));
  page.on('pageerror', e => console.log('pageerror:', String(e).slice(0, 300)));
  await page.goto('http://127.0.0.1:' + process.argv[2] + '/viewer.html');
  await page.waitForFunction('window.__loaded === true', { timeout: 60000 });
  await new Promise(r => setTimeout(r, 1500));
  await page.screenshot({ path: process.argv[3], clip: { x: 0, y: 0, width: 1600, height: 430 } });
  await browser.close();
})().catch(e => { console.error(e); process.exit(1); });
