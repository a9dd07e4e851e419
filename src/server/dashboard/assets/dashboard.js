// The live dashboard: one EventSource on /dashboard/events (no polling); each
// snapshot re-renders the page in place. A one-second timer only advances the
// heartbeat ages between snapshots; it fetches nothing.
'use strict';

(function () {
  const { el, setText, syncRows, num, ms, ago, duration, date } = MR;
  const rate = (n) => (n === 0 ? '0' : n < 0.1 ? n.toFixed(3) : n < 10 ? n.toFixed(2) : n.toFixed(0));
  const $ = (id) => document.getElementById(id);
  let snap = null;
  let receivedAt = 0;

  function serverNow() {
    return snap ? snap.now_unix_ms / 1000 + (Date.now() - receivedAt) / 1000 : Date.now() / 1000;
  }

  function say(text, bad) {
    const m = $('msg');
    m.replaceChildren(text);
    m.classList.toggle('bad', !!bad);
  }

  // ---- the feed ----
  const feed = new EventSource('/dashboard/events');
  feed.addEventListener('snapshot', (ev) => {
    snap = JSON.parse(ev.data);
    receivedAt = Date.now();
    setText($('live'), 'live');
    $('live').classList.add('on');
    render();
  });
  feed.addEventListener('error', () => {
    $('live').classList.remove('on');
    if (feed.readyState === EventSource.CLOSED) {
      setText($('live'), 'signed out');
      const link = el('a', { href: '/dashboard', text: 'Sign in again' });
      const m = $('msg');
      m.replaceChildren('The session ended. ', link, '.');
      m.classList.add('bad');
    } else {
      setText($('live'), 'reconnecting…');
    }
  });
  setInterval(tickAges, 1000);

  function render() {
    const s = snap.stats, a = snap.activity;
    setText($('c-workers'), snap.workers.length);
    setText($('c-slots'), s.worker_slots.used + ' / ' + s.worker_slots.total);
    setText($('c-queue'), s.queue.depth);
    setText($('c-wait'), 'wait p50 ' + ms(s.queue.wait_ms.p50) + ' · p95 ' + ms(s.queue.wait_ms.p95));
    setText($('c-rps'), rate(a.last_5m.requests_per_s) + ' · ' + rate(a.last_60m.requests_per_s));
    setText($('c-errors'), num(a.last_5m.errors) + ' · ' + num(a.last_60m.errors));
    setText($('c-ttft'), ms(a.ttft_ms.p50) + ' · ' + ms(a.ttft_ms.p95));
    setText($('c-tps'), rate(a.last_5m.tokens_out_per_s) + ' · ' + rate(a.last_60m.tokens_out_per_s));
    renderWorkers();
    renderErrors(a);
    columns($('chart-requests'), a.per_minute.map((m) => [m[0] - m[1], m[1]]), ['ok', 'bad'], 'requests');
    columns($('chart-tokens'), a.per_minute.map((m) => [m[2]]), ['tok'], 'output tokens');
    const byModel = Object.entries(s.tokens_by_model).map(([k, v]) => [k, v.in + v.out]);
    const byTenant = Object.entries(s.tenants).map(([k, v]) => [k, v.tokens.in + v.tokens.out]);
    bars($('bars-model'), byModel);
    bars($('bars-tenant'), byTenant);
    renderTenants(s.tenants);
    renderRecent(a.recent);
    renderKeys(snap.keys);
  }

  // ---- workers ----
  function renderWorkers() {
    $('no-workers').hidden = snap.workers.length > 0;
    syncRows($('workers').tBodies[0], snap.workers, (w) => w.id, buildWorker, updateWorker);
    renderSleeping();
    tickAges();
  }

  // Boxes asleep (Wake-on-LAN) or being woken, and the energy their sleep saved.
  function renderSleeping() {
    const list = snap.sleeping || [];
    $('sleeping').hidden = !list.length;
    setText($('sleeping'), list.length ? 'Sleeping boxes: ' + list.map((s) => {
      const hours = (Math.max(0, serverNow() - s.asleep_since_unix) + (s.slept_secs || 0)) / 3600;
      const saved = snap.idle_watts ? ', ' + Math.round(hours * snap.idle_watts) + ' Wh saved' : '';
      return s.name + ' (' + s.power + ', asleep since ' + date(s.asleep_since_unix) + saved + ')';
    }).join('; ') : '');
  }

  function buildWorker(w) {
    const drain = el('button', { type: 'button', class: 'drain', 'aria-label': 'Drain ' + w.name, text: 'Drain' });
    drain.addEventListener('click', () => drainWorker(w.id, w.name));
    return el('tr', { 'data-name': w.name },
      el('th', { scope: 'row', class: 'name' }), el('td', { class: 'backend' }), el('td', { class: 'models' }),
      el('td', { class: 'slots' }), el('td', { class: 'load' }), el('td', { class: 'heartbeat' }),
      el('td', { class: 'state' }), el('td', { class: 'protocol' }), el('td', { class: 'addr' }),
      el('td', { class: 'relays' }), el('td', {}, drain));
  }

  function short(list, n) {
    if (!list || !list.length) return 'none';
    return list.length > n ? list.slice(0, n).join(', ') + ' +' + (list.length - n) + ' more' : list.join(', ');
  }

  function updateWorker(tr, w) {
    const c = tr.cells;
    tr.dataset.heartbeat = w.last_heartbeat_unix;
    setText(c[0], w.name);
    c[0].title = w.id;
    setText(c[1], w.backend_kind || 'not reported');
    const loaded = w.loaded_models === null ? 'not reported' : short(w.loaded_models, 4);
    setText(c[2], loaded + ' / ' + short(w.models, 4));
    c[2].title = 'available: ' + w.models.join(', ');
    setText(c[3], w.in_flight + ' / ' + w.max_concurrent);
    setText(c[4], w.reported_load);
    const state = w.draining ? 'draining' : w.power === 'yielded' ? 'yielded' : w.backend_state;
    setText(c[6], state);
    c[6].className = 'state ' + state;
    c[6].title = w.backend_reason || '';
    setText(c[7], w.protocol_version || '–');
    setText(c[8], w.remote_addr);
    // The relays a worker serving several is registered with (host:port of each).
    const relays = (w.relays || []).map((u) => u.replace(/^[a-z]+:\/\//, '').replace(/\/.*$/, ''));
    setText(c[9], relays.length ? relays.join(', ') : 'this one');
    c[9].title = relays.length ? (w.relays || []).join('\n') : 'the worker reports no other relays';
    c[10].firstChild.disabled = w.draining;
  }

  // Between snapshots (an idle relay publishes none) the clocks advance here.
  function tickAges() {
    if (!snap) return;
    setText($('c-uptime'), duration(snap.uptime_secs + (Date.now() - receivedAt) / 1000));
    const now = serverNow();
    for (const tr of $('workers').tBodies[0].rows) {
      setText(tr.cells[5], ago(now - Number(tr.dataset.heartbeat)));
    }
  }

  async function drainWorker(id, name) {
    if (!confirm('Drain worker "' + name + '"? It finishes what it is running, takes no new requests, then disconnects.')) return;
    const [ok, data, status] = await MR.post('/dashboard/api/workers/' + encodeURIComponent(id) + '/drain', {});
    say(ok ? 'Draining ' + name + '.' : MR.errorText(data, status), !ok);
  }

  $('refresh-models').addEventListener('click', async () => {
    if (!confirm('Ask every worker to re-read its backend\'s models now?')) return;
    const [ok, data, status] = await MR.post('/dashboard/api/models/refresh', {});
    say(ok ? (data.refresh_sent ? 'Model refresh sent to every worker.' : 'No worker is connected.') : MR.errorText(data, status), !ok);
  });

  // ---- traffic ----
  function renderErrors(a) {
    const reasons = new Set([...Object.keys(a.last_5m.errors_by_reason), ...Object.keys(a.last_60m.errors_by_reason)]);
    const rows = [...reasons].sort().map((r) => [r, a.last_5m.errors_by_reason[r] || 0, a.last_60m.errors_by_reason[r] || 0]);
    if (!rows.length) rows.push(['none', 0, 0]);
    syncRows($('errors').tBodies[0], rows, (r) => r[0],
      () => el('tr', {}, el('th', { scope: 'row' }), el('td'), el('td')),
      (tr, r) => r.forEach((v, i) => setText(tr.cells[i], v)));
  }

  // Stacked columns, one per minute, oldest on the left.
  function columns(svg, series, classes, what) {
    const W = 600, H = 120, n = series.length, bw = W / n;
    const max = Math.max(1, ...series.map((s) => s.reduce((x, y) => x + y, 0)));
    svg.setAttribute('viewBox', '0 0 ' + W + ' ' + (H + 14));
    const nodes = [el('svg:title', { text: what + ' per minute over the last hour; most ' + max })];
    series.forEach((stack, i) => {
      let y = H;
      stack.forEach((v, j) => {
        if (!v) return;
        const h = (v / max) * H;
        y -= h;
        nodes.push(el('svg:rect', { x: (i * bw + 0.5).toFixed(1), y: y.toFixed(1), width: (bw - 1).toFixed(1), height: h.toFixed(1), class: classes[j] }));
      });
    });
    nodes.push(el('svg:line', { x1: 0, y1: H, x2: W, y2: H, class: 'axis' }));
    nodes.push(el('svg:text', { x: 2, y: 10, class: 'axis-label', text: 'max ' + num(max) }));
    nodes.push(el('svg:text', { x: 2, y: H + 12, class: 'axis-label', text: '60 min ago' }));
    nodes.push(el('svg:text', { x: W - 2, y: H + 12, class: 'axis-label end', text: 'now' }));
    svg.replaceChildren(...nodes);
  }

  // Horizontal bars: label, bar, value.
  function bars(svg, entries) {
    entries.sort((x, y) => y[1] - x[1]);
    entries = entries.slice(0, 10);
    const W = 400, row = 22, H = Math.max(1, entries.length) * row;
    const max = Math.max(1, ...entries.map((e) => e[1]));
    svg.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
    svg.setAttribute('preserveAspectRatio', 'xMinYMin meet');
    svg.setAttribute('height', H);
    const nodes = [];
    if (!entries.length) nodes.push(el('svg:text', { x: 0, y: 15, class: 'axis-label', text: 'nothing yet' }));
    entries.forEach(([label, v], i) => {
      const y = i * row;
      nodes.push(el('svg:text', { x: 0, y: y + 15, class: 'bar-label', text: label.length > 18 ? label.slice(0, 17) + '…' : label }));
      nodes.push(el('svg:rect', { x: 130, y: y + 4, width: Math.max(1, (v / max) * 200).toFixed(1), height: row - 8, class: 'tok' }));
      nodes.push(el('svg:text', { x: 336, y: y + 15, class: 'bar-value', text: num(v) }));
    });
    svg.replaceChildren(...nodes);
  }

  // ---- tables ----
  function cellsRow(n) {
    return () => el('tr', {}, el('th', { scope: 'row' }), ...Array.from({ length: n - 1 }, () => el('td')));
  }

  function fill(tr, values) {
    values.forEach((v, i) => setText(tr.cells[i], v));
  }

  function renderTenants(tenants) {
    const rows = Object.entries(tenants).sort();
    syncRows($('tenants').tBodies[0], rows, (r) => r[0], cellsRow(7), (tr, [name, t]) => fill(tr, [
      name, t.queued, t.in_flight, num(t.completed),
      num(Object.values(t.rejected_by_reason).reduce((x, y) => x + y, 0)),
      ms(t.wait_ms.p50) + ' · ' + ms(t.wait_ms.p95),
      num(t.tokens.in) + ' · ' + num(t.tokens.out),
    ]));
  }

  function renderRecent(recent) {
    syncRows($('recent').tBodies[0], recent, (r) => r.id + '/' + r.finished_unix, cellsRow(8), (tr, r) => {
      fill(tr, [r.id, r.route, r.model, r.worker || '–', r.status + (r.outcome === 'completed' ? '' : ' ' + r.outcome),
        r.wait_ms === null ? '–' : ms(r.wait_ms), ms(r.duration_ms), num(r.tokens_out)]);
      tr.classList.toggle('bad', r.outcome !== 'completed');
    });
  }

  // ---- keys ----
  function renderKeys(keys) {
    const list = keys.slice().sort((x, y) => (x.revoked - y.revoked) || (y.created_unix - x.created_unix));
    syncRows($('keys').tBodies[0], list, (k) => k.id, (k) => {
      const revoke = el('button', { type: 'button', class: 'revoke', 'aria-label': 'Revoke key ' + k.name, text: 'Revoke' });
      revoke.addEventListener('click', () => revokeKey(k.id, k.name));
      const tr = cellsRow(7)();
      tr.dataset.name = k.name;
      tr.cells[6].append(revoke);
      return tr;
    }, (tr, k) => {
      fill(tr, [k.name, k.id, k.tenant || '–', date(k.created_unix), date(k.last_used_unix), k.revoked ? 'revoked' : 'active']);
      tr.cells[6].firstChild.hidden = k.revoked;
    });
  }

  $('key-form').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const name = $('key-name').value.trim();
    const tenant = $('key-tenant').value.trim();
    if (!name) return;
    if (!confirm('Create a client key named "' + name + '"' + (tenant ? ' for tenant ' + tenant : '') + '?')) return;
    const body = { name };
    if (tenant) body.tenant = tenant;
    const [ok, data, status] = await MR.post('/dashboard/api/keys', body);
    if (!ok) return say(MR.errorText(data, status), true);
    $('key-form').reset();
    setText($('new-key-name'), data.name + ' (' + data.id + ')');
    $('new-key-secret').value = data.key;
    $('new-key').hidden = false;
    $('new-key-secret').focus();
    $('new-key-secret').select();
    say('Key ' + data.name + ' created.');
  });
  $('new-key-copy').addEventListener('click', (ev) => MR.copy($('new-key-secret'), ev.currentTarget));
  $('new-key-done').addEventListener('click', () => {
    $('new-key-secret').value = '';
    $('new-key').hidden = true;
    $('key-name').focus();
  });

  async function revokeKey(id, name) {
    if (!confirm('Revoke key "' + name + '" (' + id + ')? Clients using it are refused from now on.')) return;
    const [ok, data, status] = await MR.post('/dashboard/api/keys/' + encodeURIComponent(id) + '/revoke', {});
    say(ok ? 'Key ' + name + ' revoked.' : MR.errorText(data, status), !ok);
  }
})();
