// The connect-a-worker wizard: builds the exact commands for the chosen platform and
// backend from /setup/info (this server's URL, the worker secret for a signed-in
// operator, downloadable binaries and their SHA-256, the systemd unit), then watches
// the dashboard feed (one EventSource, no polling) for a worker with the chosen name.
'use strict';

(function () {
  const { el, setText } = MR;
  const $ = (id) => document.getElementById(id);
  const PLACEHOLDER = 'PASTE-THE-SERVERS-WORKER_SECRET';
  const WAIT_SECS = 60;

  const PLATFORMS = {
    'linux-x86_64': { target: 'x86_64-unknown-linux-musl', os: 'linux' },
    'linux-aarch64': { target: 'aarch64-unknown-linux-musl', os: 'linux' },
    'linux-armv7': { target: 'armv7-unknown-linux-musleabihf', os: 'linux' },
    'macos-arm64': { target: 'aarch64-apple-darwin', os: 'macos' },
    'macos-x86_64': { target: 'x86_64-apple-darwin', os: 'macos' },
    'windows-x86_64': { target: 'x86_64-pc-windows-msvc', os: 'windows' },
  };
  const BACKENDS = {
    'llama-server': { url: 'http://127.0.0.1:8080', kind: 'llama-server',
      hint: 'Start it with e.g. llama-server -m model.gguf --port 8080 -np 4; -np is its slot count, use the same number for parallel requests. (If the relay runs on the same machine on 8080, pick another port.)' },
    'ollama': { url: 'http://127.0.0.1:11434', kind: 'ollama',
      hint: 'Ollama listens on 11434; OLLAMA_NUM_PARALLEL is how many requests it runs at once.' },
    'vllm': { url: 'http://127.0.0.1:8000', kind: 'vllm',
      hint: 'Start it with e.g. vllm serve <model> --port 8000.' },
    'openai': { url: 'http://127.0.0.1:8000', kind: 'openai',
      hint: 'Any server answering OpenAI-style /v1/chat/completions and /v1/models.' },
  };

  let info = null;
  let urlEdited = false;
  let chosen = null;         // the worker name being watched
  let shownAt = 0;           // when the commands were shown (ms)
  let baseline = null;       // worker auth failures when they were shown
  let latest = null;         // the latest feed snapshot
  let feed = null;

  const picked = (name) => document.querySelector('input[name="' + name + '"]:checked').value;

  function backendChanged() {
    const b = BACKENDS[picked('backend')];
    setText($('backend-hint'), b.hint);
    if (!urlEdited) $('backend-url').value = b.url;
  }

  function platformChanged() {
    const linux = PLATFORMS[picked('platform')].os === 'linux';
    const systemd = document.querySelector('input[name="run"][value="systemd"]');
    systemd.disabled = !linux;
    if (!linux) document.querySelector('input[name="run"][value="shell"]').checked = true;
  }

  document.querySelectorAll('input[name="backend"]').forEach((r) => r.addEventListener('change', backendChanged));
  document.querySelectorAll('input[name="platform"]').forEach((r) => r.addEventListener('change', platformChanged));
  $('backend-url').addEventListener('input', () => { urlEdited = true; });

  // ---- quoting for what the operator pastes ----
  const sh = (v) => "'" + String(v).replace(/'/g, "'\\''") + "'";
  const ps = (v) => "'" + String(v).replace(/'/g, "''") + "'";
  const envFile = (v) => (/^[A-Za-z0-9_.\/:@,*+=-]*$/.test(v) ? v : '"' + v.replace(/[\\"]/g, '\\$&') + '"');

  function block(title, text, id) {
    const pre = el('pre', { id: id, tabindex: 0 }, el('code', { text: text }));
    const copy = el('button', { type: 'button', class: 'quiet', 'aria-label': 'Copy: ' + title, text: 'Copy' });
    copy.addEventListener('click', () => MR.copy(pre, copy));
    return el('div', {}, el('div', { class: 'block-head' }, el('h3', { text: title }), copy), pre);
  }

  function settings() {
    const name = $('worker-name').value.trim();
    if (!/^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/.test(name)) return [null, 'The worker name may use letters, digits, . _ - (up to 64, starting with a letter or digit).'];
    const url = $('backend-url').value.trim();
    if (!/^https?:\/\/\S+$/.test(url)) return [null, 'The backend URL starts with http:// or https://.'];
    const slots = parseInt($('max-concurrency').value, 10);
    if (!(slots >= 1)) return [null, 'Parallel requests is a whole number, at least 1.'];
    const models = $('models').value.trim() || '*';
    const backend = BACKENDS[picked('backend')];
    const env = [
      ['PROXY_URL', info.public_url],
      ['WORKER_SECRET', info.worker_secret || PLACEHOLDER],
      ['WORKER_NAME', name],
      ['BACKEND_URL', url],
      ['BACKEND_KIND', backend.kind],
      ['MAX_CONCURRENCY', String(slots)],
      ['MODELS', models],
    ];
    if (info.provider && info.provider !== 'local') env.push(['PROVIDER_NAME', info.provider]);
    return [{ name, env, platform: PLATFORMS[picked('platform')], run: picked('run') }, null];
  }

  function downloadPart(s) {
    const t = s.platform.target;
    const exe = s.platform.os === 'windows' ? 'modelrelay-worker.exe' : 'modelrelay-worker';
    const file = info.downloads[t];
    if (!file) {
      const why = info.download_dir_configured
        ? 'This server has no worker binary for ' + t + ' in its download directory.'
        : 'This server hands out no binaries (its WORKER_DOWNLOAD_DIR is not set).';
      return el('div', { id: 'no-download' },
        el('h3', { text: 'Get the worker binary' }),
        el('p', { text: why + ' Take modelrelay-worker for ' + t + ' from your release downloads, or build it from the source with Rust:' }),
        el('pre', {}, el('code', { text: 'cargo build --release --bin modelrelay-worker --target ' + t })));
    }
    const url = info.public_url + '/setup/download/' + t;
    let text;
    if (s.platform.os === 'windows') {
      text = 'Invoke-WebRequest -Uri ' + ps(url) + ' -OutFile ' + exe + '\n' +
        '(Get-FileHash ' + exe + ' -Algorithm SHA256).Hash -eq ' + ps(file.sha256.toUpperCase());
    } else {
      const check = s.platform.os === 'macos' ? 'shasum -a 256 -c -' : 'sha256sum -c -';
      text = 'curl -fL -o ' + exe + ' ' + sh(url) + '\n' +
        "echo '" + file.sha256 + '  ' + exe + "' | " + check + '\n' +
        'chmod +x ' + exe;
    }
    const part = block('Get the worker binary', text, 'cmd-download');
    part.append(el('p', { class: 'hint' }, 'Or download ', el('a', { href: '/setup/download/' + t, text: file.file }),
      ' (' + Math.round(file.size / 1024) + ' KiB), SHA-256 ', el('code', { id: 'download-sha', text: file.sha256 })));
    return part;
  }

  function runPart(s) {
    const out = el('div');
    if (s.run === 'systemd') {
      const envPath = '/etc/modelrelay/worker-' + s.name + '.env';
      const env = s.env.map(([k, v]) => k + '=' + envFile(v)).join('\n');
      out.append(block('Install it with its settings', [
        'sudo install -m 755 modelrelay-worker /usr/local/bin/modelrelay-worker',
        'sudo install -d -m 755 /etc/modelrelay',
        "sudo tee " + envPath + " >/dev/null <<'EOF'", env, 'EOF',
        'sudo chmod 600 ' + envPath].join('\n'), 'cmd-env'));
      out.append(block('Add the service and start it', [
        "sudo tee /etc/systemd/system/modelrelay-worker@.service >/dev/null <<'EOF'",
        info.systemd_unit.trimEnd(), 'EOF',
        'sudo systemctl daemon-reload',
        'sudo systemctl enable --now modelrelay-worker@' + s.name,
        'journalctl -u modelrelay-worker@' + s.name + ' -f'].join('\n'), 'cmd-run'));
    } else if (s.platform.os === 'windows') {
      const lines = s.env.map(([k, v]) => '$env:' + k + ' = ' + ps(v));
      lines.push('.\\modelrelay-worker.exe');
      out.append(block('Start it (PowerShell)', lines.join('\n'), 'cmd-run'));
    } else {
      const lines = s.env.map(([k, v]) => k + '=' + sh(v) + ' \\');
      lines.push('  ./modelrelay-worker');
      out.append(block('Start it', lines.join('\n'), 'cmd-run'));
    }
    if (!info.worker_secret) {
      out.append(el('p', { class: 'hint', text: 'Replace ' + PLACEHOLDER + ' with the server\'s WORKER_SECRET (signed-in operators see it filled in).' }));
    }
    return out;
  }

  $('wizard').addEventListener('submit', (ev) => {
    ev.preventDefault();
    if (!info) return;
    const [s, problem] = settings();
    setText($('form-error'), problem || '');
    if (!s) return;
    $('download').replaceChildren(downloadPart(s));
    $('run').replaceChildren(runPart(s));
    $('commands').hidden = false;
    startCheck(s.name);
    // Smooth only for visitors who have not asked for less motion.
    const still = window.matchMedia('(prefers-reduced-motion: reduce)').matches;
    $('h-commands').scrollIntoView({ behavior: still ? 'auto' : 'smooth', block: 'start' });
  });

  // ---- the live check ----
  function startCheck(name) {
    $('check-section').hidden = false;
    if (!info.signed_in) {
      $('check').className = 'check card';
      $('check').replaceChildren('Sign in to watch for the worker here: ',
        el('a', { href: '/dashboard/signin?next=/setup', text: 'sign in' }), '.');
      return;
    }
    chosen = name;
    shownAt = Date.now();
    baseline = latest ? failures(latest) : null;
    if (!feed) {
      feed = new EventSource('/dashboard/events');
      feed.addEventListener('snapshot', (e) => {
        latest = JSON.parse(e.data);
        if (baseline === null) baseline = failures(latest);
        showCheck();
      });
      setInterval(showCheck, 1000);
    }
    showCheck();
  }

  const failures = (snap) => (snap.stats.auth_failures && snap.stats.auth_failures.worker) || 0;

  // The box is rebuilt only when what it says changes (a worker appears, its models or
  // backend change, a refusal, the wait runs out); the seconds count in place. So a
  // tick of the clock or a feed snapshot that changes nothing here replaces no element
  // (a screen reader does not hear the box again, a selection in it survives).
  function render(box, state, key, build) {
    if (box.dataset.state === state && box.dataset.key === key) return;
    box.className = 'check card ' + (state === 'connected' ? 'ok' : state === 'waiting' ? 'waiting' : 'warn');
    box.dataset.state = state;
    box.dataset.key = key;
    box.replaceChildren(...build());
  }

  const secsSpan = () => el('span', { id: 'check-secs', 'aria-hidden': 'true' });

  function showCheck() {
    if (!chosen) return;
    const box = $('check');
    const worker = latest && latest.workers.find((w) => w.name === chosen);
    if (worker) {
      const models = worker.models.length ? worker.models.join(', ') : 'none yet (is the backend running?)';
      const key = JSON.stringify([chosen, worker.remote_addr, models, worker.backend_state, worker.backend_reason]);
      render(box, 'connected', key, () => {
        const parts = [el('strong', { text: 'Connected: ' + chosen }), ' from ' + worker.remote_addr + '. Models: ',
          el('span', { id: 'check-models', text: models }), '.'];
        if (worker.backend_state !== 'up') parts.push(' Its backend is ' + worker.backend_state + (worker.backend_reason ? ': ' + worker.backend_reason : '') + '.');
        parts.push(' ', el('a', { href: '/dashboard', text: 'See it on the dashboard' }), '.');
        return parts;
      });
      return;
    }
    const secs = Math.floor((Date.now() - shownAt) / 1000);
    const refused = latest && baseline !== null ? failures(latest) - baseline : 0;
    if (refused > 0) {
      render(box, 'wrong-secret', JSON.stringify([chosen, refused]), () => [
        el('strong', { text: 'A worker was refused ' + refused + ' time(s) for a wrong secret. ' }),
        'Check that WORKER_SECRET on the worker is exactly the server\'s (no quotes or spaces carried over), then restart it.']);
      return;
    }
    if (secs < WAIT_SECS) {
      render(box, 'waiting', JSON.stringify([chosen, shownAt]), () => [
        'Waiting for a worker named ', el('strong', { text: chosen }), ' to connect…', secsSpan()]);
    } else {
      render(box, 'nothing', JSON.stringify([chosen, shownAt]), () => [
        el('strong', { text: 'Nothing from ' + chosen + ' so far.' }), secsSpan(), ' Still watching. Usual causes:',
        el('ul', { class: 'causes' },
          el('li', { text: 'The worker machine cannot reach ' + info.public_url + ' (firewall, wrong address or port; try curl ' + info.public_url + '/health from it).' }),
          el('li', { text: 'A reverse proxy in front of the relay does not pass WebSocket upgrades on /v1/worker/connect.' }),
          el('li', { text: 'The worker is not running or exited: look at its output (journalctl -u modelrelay-worker@' + chosen + ').' }),
          el('li', { text: 'WORKER_NAME on the worker differs from ' + chosen + '.' }))]);
    }
    setText($('check-secs'), ' (' + secs + ' s)');
  }

  // ---- start ----
  fetch('/setup/info', { credentials: 'same-origin' })
    .then((r) => r.json())
    .then((data) => {
      info = data;
      $('signin-note').hidden = data.signed_in || !data.admin_enabled;
      $('admin-note').hidden = data.admin_enabled;
      backendChanged();
      platformChanged();
    })
    .catch(() => setText($('form-error'), 'Cannot reach the server for its settings; reload the page.'));
})();
