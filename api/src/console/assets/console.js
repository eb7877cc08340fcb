// The vps console: plain DOM and fetch against the JSON API (POST /api/compute/<group>/<method>)
// with the token kept in this tab's sessionStorage. Pages are hash routes; the page shown is
// refreshed every second, and the events page follows the server-sent event stream.
'use strict';

const SVG_NS = 'http://www.w3.org/2000/svg';
const REFRESH_MS = 1000;
const EVENTS_KEPT = 200;

// ---- DOM helpers: text goes in as text, never as HTML --------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  return fill(el, attrs, children);
}

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  return fill(el, attrs, children);
}

function fill(el, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === false || value === null || value === undefined) continue;
    if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? '' : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function stateBadge(state) {
  return h('span', { class: `state state-${state}` }, state);
}

function when(iso) {
  if (!iso) return '';
  const d = new Date(iso);
  // Today's times without the date: lists stay narrow.
  const today = d.toDateString() === new Date().toDateString();
  return today ? d.toLocaleTimeString() : d.toLocaleString(undefined, { dateStyle: 'short', timeStyle: 'medium' });
}

function duration(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  const [d, hr, m, sec] = [Math.floor(s / 86400), Math.floor(s / 3600) % 24, Math.floor(s / 60) % 60, s % 60];
  if (d) return `${d}d ${hr}h`;
  if (hr) return `${hr}h ${m}m`;
  if (m) return `${m}m ${sec}s`;
  return `${sec}s`;
}

function table(id, headings, tbody) {
  return h('table', { id }, h('thead', {}, h('tr', {}, headings.map((t) => h('th', {}, t)))), tbody);
}

function rows(tbody, items, row, empty) {
  const columns = tbody.parentElement ? tbody.parentElement.querySelectorAll('th').length : 1;
  tbody.replaceChildren(...(items.length ? items.map(row) : [h('tr', {}, h('td', { class: 'empty', colspan: columns }, empty))]));
}

function fields(dl, pairs) {
  dl.replaceChildren(...pairs.flatMap(([name, value]) => [h('dt', {}, name), h('dd', {}, value ?? '')]));
}

// A button that asks again in place (no browser dialog) before doing something it cannot undo.
function confirming(label, action) {
  let armed = null;
  const button = h('button', { type: 'button', class: 'danger' }, label);
  button.addEventListener('click', async () => {
    if (!armed) {
      button.textContent = `Confirm ${label.toLowerCase()}`;
      armed = setTimeout(() => { armed = null; button.textContent = label; }, 5000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    button.textContent = label;
    await act(button, action);
  });
  return button;
}

async function act(button, action) {
  button.disabled = true;
  try {
    await action();
    hideError();
    await refreshNow();
  } catch (e) {
    showError(e);
  } finally {
    button.disabled = false;
  }
}

function freshKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return 'console-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

// ---- session and API ------------------------------------------------------------------------

const session = {
  get token() { return sessionStorage.getItem('vps.token'); },
  get tenant() { return sessionStorage.getItem('vps.tenant'); },
  save(token, tenant) {
    sessionStorage.setItem('vps.token', token);
    sessionStorage.setItem('vps.tenant', tenant);
  },
  clear() {
    sessionStorage.removeItem('vps.token');
    sessionStorage.removeItem('vps.tenant');
  },
};

class ApiError extends Error {
  constructor(code, message, status) {
    super(`${code}: ${message}`);
    this.code = code;
    this.status = status;
  }
}

async function call(method, body, token = session.token) {
  const [group, name] = method.split('.');
  const response = await fetch(`/api/compute/${group}/${name}`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${token}`, 'Content-Type': 'application/json' },
    body: JSON.stringify(body || {}),
  });
  let answer = null;
  try { answer = await response.json(); } catch (_) { /* not JSON: reported below */ }
  if (!response.ok) {
    const error = new ApiError(answer?.code || `HTTP_${response.status}`, answer?.message || response.statusText, response.status);
    if (response.status === 401 && token === session.token && session.tenant) {
      // The key was revoked or the server restarted with other tokens: sign in again.
      session.clear();
      route();
    }
    throw error;
  }
  return answer;
}

function tenant() {
  return session.tenant;
}

function showError(e) {
  const box = document.getElementById('error');
  box.textContent = e instanceof Error ? e.message : String(e);
  box.hidden = false;
}

function hideError() {
  document.getElementById('error').hidden = true;
}

// ---- routing and the refresh loop -----------------------------------------------------------

let current = null;

function route() {
  if (current?.leave) current.leave();
  current = null;
  hideError();
  const main = document.getElementById('main');
  main.replaceChildren();
  const header = document.getElementById('top');
  if (!session.token || !session.tenant) {
    header.hidden = true;
    signIn(main);
    return;
  }
  header.hidden = false;
  document.getElementById('tenant-name').textContent = session.tenant;
  const [, page, id] = location.hash.split('/');
  if (!PAGES[page]) {
    location.replace('#/instances');
    return;
  }
  for (const a of header.querySelectorAll('nav a')) {
    a.classList.toggle('current', a.getAttribute('href') === `#/${page}`);
  }
  current = PAGES[page](main, id ? decodeURIComponent(id) : null);
  refreshNow();
}

let refreshing = null;

async function refreshNow() {
  const view = current;
  if (!view?.refresh) return;
  if (refreshing) await refreshing;
  refreshing = (async () => {
    try {
      await view.refresh();
    } catch (e) {
      if (view === current) showError(e);
    }
  })();
  await refreshing;
  refreshing = null;
}

async function loop() {
  await refreshNow();
  setTimeout(loop, REFRESH_MS);
}

// ---- sign in --------------------------------------------------------------------------------

function signIn(main) {
  const token = h('input', { id: 'signin-token', name: 'token', type: 'password', required: true, autocomplete: 'off', placeholder: 'API token' });
  const tenantField = h('input', { id: 'signin-tenant', name: 'tenant', placeholder: 'found from the token if left empty' });
  const button = h('button', { type: 'submit' }, 'Sign in');
  const form = h('form', { id: 'signin-form' },
    h('label', {}, 'API token', token),
    h('label', {}, 'Tenant', tenantField),
    button);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    button.disabled = true;
    try {
      const key = token.value.trim();
      let id = tenantField.value.trim();
      if (!id) {
        // A tenant token reads only its own tenant's events: the first one names it.
        const page = await call('events.list', { limit: 1 }, key);
        id = page.items[0]?.tenantid;
        if (!id) throw new Error('No event names this token\'s tenant yet: type the tenant id.');
      }
      await call('instances.list', { tenantId: id, limit: 1 }, key);
      session.save(key, id);
      route();
    } catch (e) {
      showError(e);
    } finally {
      button.disabled = false;
    }
  });
  main.append(h('section', { id: 'signin', class: 'card' },
    h('h1', {}, 'Sign in to vps'),
    h('p', { class: 'note' }, 'The token stays in this tab only and is sent to this server\'s API.'),
    form));
}

// ---- instances ------------------------------------------------------------------------------

function instancesPage(main, id) {
  return id ? instanceDetail(main, id) : instanceList(main);
}

function instanceList(main) {
  const tbody = h('tbody');
  const pools = h('datalist', { id: 'pool-ids' });
  const flavors = h('datalist', { id: 'flavor-names' });
  const images = h('datalist', { id: 'image-ids' });
  const input = (name, placeholder, list) =>
    h('input', { name, required: true, placeholder, list, value: sessionStorage.getItem(`vps.last.${name}`) || '' });
  const pool = input('poolId', 'pool_…', 'pool-ids');
  const flavor = input('flavor', 'small', 'flavor-names');
  const image = input('imageId', 'img_…', 'image-ids');
  const create = h('button', { type: 'submit', id: 'create-button' }, 'Create');
  const result = h('span', { class: 'note', id: 'create-result' });
  const form = h('form', { id: 'create-instance', class: 'card inline' },
    h('label', {}, 'Pool', pool), h('label', {}, 'Flavor', flavor), h('label', {}, 'Image', image),
    create, result, pools, flavors, images);

  const flavorsOf = async () => {
    if (!pool.value.trim()) return;
    try {
      const page = await call('flavors.list', { poolId: pool.value.trim() });
      flavors.replaceChildren(...page.items.map((f) => h('option', { value: f.name })));
    } catch (_) { /* not offered yet: the create says so */ }
  };
  pool.addEventListener('change', flavorsOf);
  call('images.list', {}).then((page) => {
    images.replaceChildren(...page.items.map((i) => h('option', { value: i.id })));
  }, () => {});
  flavorsOf();

  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    await act(create, async () => {
      const body = { tenantId: tenant(), poolId: pool.value.trim(), flavor: flavor.value.trim(), imageId: image.value.trim(), idempotencyKey: freshKey() };
      const made = await call('instances.create', body);
      for (const [name, field] of [['poolId', pool], ['flavor', flavor], ['imageId', image]]) {
        sessionStorage.setItem(`vps.last.${name}`, field.value.trim());
      }
      result.replaceChildren('Created ', h('a', { href: `#/instances/${made.id}` }, made.id));
    });
  });

  main.append(h('h1', {}, 'Instances'), form,
    table('instances', ['Instance', 'State', 'Pool', 'Node', 'Flavor', 'Image', 'Created'], tbody));
  const known = new Set();
  return {
    async refresh() {
      const page = await call('instances.list', { tenantId: tenant(), limit: 100 });
      rows(tbody, page.items, (i) => h('tr', { 'data-id': i.id },
        h('td', { class: 'mono' }, h('a', { href: `#/instances/${i.id}` }, i.id)),
        h('td', { class: 'state' }, stateBadge(i.state)),
        h('td', { class: 'mono' }, i.poolId),
        h('td', { class: 'mono' }, i.nodeId || ''),
        h('td', {}, i.flavor),
        h('td', { class: 'mono' }, i.imageId),
        h('td', { class: 'time' }, when(i.createdAt))), 'No instances yet: create one above.');
      for (const i of page.items) {
        if (!known.has(i.poolId)) {
          known.add(i.poolId);
          pools.append(h('option', { value: i.poolId }));
        }
      }
    },
  };
}

function instanceDetail(main, id) {
  const dl = h('dl', { class: 'fields', id: 'instance-fields' });
  const history = h('tbody');
  const ref = () => ({ tenantId: tenant(), instanceId: id });
  const start = h('button', { type: 'button', id: 'instance-start', class: 'quiet' }, 'Start');
  const stop = h('button', { type: 'button', id: 'instance-stop', class: 'quiet' }, 'Stop');
  const remove = confirming('Delete', () => call('instances.delete', ref()));
  remove.id = 'instance-delete';
  start.addEventListener('click', () => act(start, () => call('instances.start', ref())));
  stop.addEventListener('click', () => act(stop, () => call('instances.stop', ref())));
  main.append(
    h('p', {}, h('a', { href: '#/instances' }, '← Instances')),
    h('h1', {}, 'Instance ', h('span', { class: 'mono' }, id)),
    h('section', { class: 'card' }, dl),
    h('div', { class: 'actions' }, start, stop, remove),
    h('h2', {}, 'History'),
    table('instance-history', ['Time', 'Event', 'Actor', 'Data'], history));
  return {
    async refresh() {
      const [i, events] = await Promise.all([call('instances.get', ref()), call('instances.history', ref())]);
      fields(dl, [
        ['State', h('span', { id: 'instance-state' }, stateBadge(i.state))],
        ['Desired', i.desiredState],
        ['Pool', i.poolId], ['Node', i.nodeId || '—'], ['Flavor', i.flavor], ['Image', i.imageId],
        ['Addresses', i.addresses.join(', ') || '—'],
        ['Conditions', i.conditions.map((c) => c.message || c.reason || c.type).join('; ') || '—'],
        ['Sandbox', i.sandboxId ? h('a', { href: `#/sandboxes/${i.sandboxId}` }, i.sandboxId) : '—'],
        ['Created', when(i.createdAt)],
      ]);
      const gone = i.state === 'deleted' || i.state === 'deleting';
      start.disabled = gone || (i.desiredState === 'running' && i.state !== 'error');
      stop.disabled = gone || i.desiredState === 'stopped';
      remove.disabled = gone;
      rows(history, events.items.slice().reverse(), (e) => h('tr', {},
        h('td', { class: 'time' }, when(e.time)),
        h('td', { class: 'mono' }, e.type),
        h('td', { class: 'mono' }, e.actor || ''),
        h('td', { class: 'mono data' }, summary(e.data))), 'No events.');
    },
  };
}

// A short line for an event's data: its scalar fields, long values cut.
function summary(data) {
  if (!data || typeof data !== 'object') return '';
  return Object.entries(data)
    .filter(([, v]) => v !== null && typeof v !== 'object')
    .map(([k, v]) => `${k}=${String(v).length > 40 ? String(v).slice(0, 39) + '…' : v}`)
    .join(' ');
}

// ---- sandboxes ------------------------------------------------------------------------------

function scopeToggle(id) {
  const box = h('input', { type: 'checkbox', id });
  box.addEventListener('change', refreshNow);
  return [box, h('label', { class: 'toggle' }, box, ' Everyone\'s')];
}

function countdown(expiresAt, state) {
  if (state === 'deleted' || state === 'deleting') return '';
  const left = new Date(expiresAt) - Date.now();
  return h('span', { class: left < 5 * 60 * 1000 ? 'soon' : '' }, left > 0 ? `in ${duration(left)}` : 'now');
}

function sandboxesPage(main, id) {
  return id ? sandboxDetail(main, id) : sandboxList(main);
}

function sandboxList(main) {
  const tbody = h('tbody');
  const [all, toggle] = scopeToggle('sandboxes-all');
  main.append(h('h1', {}, 'Sandboxes'), h('p', {}, toggle),
    table('sandboxes', ['Sandbox', 'State', 'Template', 'Instance', 'Expires', 'Created'], tbody));
  return {
    async refresh() {
      const page = await call('sandboxes.list', { tenantId: tenant(), scope: all.checked ? 'all' : 'mine', limit: 100 });
      rows(tbody, page.items, (s) => h('tr', { 'data-id': s.id },
        h('td', { class: 'mono' }, h('a', { href: `#/sandboxes/${s.id}` }, s.id)),
        h('td', {}, stateBadge(s.state)),
        h('td', { class: 'mono' }, s.templateId),
        h('td', { class: 'mono' }, h('a', { href: `#/instances/${s.instanceId}` }, s.instanceId)),
        h('td', {}, countdown(s.expiresAt, s.state)),
        h('td', { class: 'time' }, when(s.createdAt))), 'No sandboxes.');
    },
  };
}

function sandboxDetail(main, id) {
  const dl = h('dl', { class: 'fields', id: 'sandbox-fields' });
  const snapshots = h('tbody');
  const ref = () => ({ tenantId: tenant(), sandboxId: id });
  const extend = h('button', { type: 'button', id: 'sandbox-extend', class: 'quiet' }, '+30 min');
  extend.addEventListener('click', () => act(extend, () => call('sandboxes.extend', { ...ref(), by: '30m' })));
  const remove = confirming('Delete', () => call('sandboxes.delete', ref()));
  remove.id = 'sandbox-delete';
  main.append(
    h('p', {}, h('a', { href: '#/sandboxes' }, '← Sandboxes')),
    h('h1', {}, 'Sandbox ', h('span', { class: 'mono' }, id)),
    h('section', { class: 'card' }, dl),
    h('div', { class: 'actions' }, extend, remove),
    h('p', { class: 'note' }, 'A shell: ', h('code', {}, `vps sandboxes exec ${id}`)),
    h('h2', {}, 'Snapshots'),
    table('sandbox-snapshots', ['Snapshot', 'State', 'Memory', 'Kept', 'Size', 'Taken'], snapshots));
  return {
    async refresh() {
      const s = await call('sandboxes.get', ref());
      fields(dl, [
        ['State', h('span', { id: 'sandbox-state' }, stateBadge(s.state))],
        ['Template', s.templateId],
        ['Instance', h('a', { href: `#/instances/${s.instanceId}` }, s.instanceId)],
        ['Warm claim', s.warm ? 'yes' : 'no'],
        ['Expires', [when(s.expiresAt), ' ', countdown(s.expiresAt, s.state)]],
        ['From snapshot', s.fromSnapshot || '—'],
        ['Created', when(s.createdAt)],
        ['Ready', when(s.readyAt) || '—'],
      ]);
      const gone = s.state === 'deleted' || s.state === 'deleting';
      extend.disabled = gone;
      remove.disabled = gone;
      rows(snapshots, s.snapshots || [], (p) => h('tr', {},
        h('td', { class: 'mono' }, p.id),
        h('td', {}, stateBadge(p.state)),
        h('td', {}, p.includeMemory ? 'yes' : 'no'),
        h('td', {}, p.keep ? 'yes' : 'no'),
        h('td', {}, p.sizeBytes ? `${(p.sizeBytes / 1048576).toFixed(1)} MiB` : ''),
        h('td', { class: 'time' }, when(p.createdAt))), 'No snapshots.');
    },
  };
}

// ---- templates and volumes ------------------------------------------------------------------

function templatesPage(main) {
  const tbody = h('tbody');
  main.append(h('h1', {}, 'Templates'),
    table('templates', ['Name', 'Template', 'Pool', 'Flavor', 'Image', 'Runtime', 'Lifetime', 'Warm', 'Volumes'], tbody));
  return {
    async refresh() {
      const page = await call('sandboxTemplates.list', { tenantId: tenant() });
      rows(tbody, page.items, (t) => h('tr', { 'data-id': t.id },
        h('td', {}, t.name),
        h('td', { class: 'mono' }, t.id),
        h('td', { class: 'mono' }, t.poolId),
        h('td', {}, t.flavor),
        h('td', { class: 'mono' }, t.imageId),
        h('td', {}, t.runtime),
        h('td', {}, `${duration(t.defaultTtlSeconds * 1000)} (max ${duration(t.maxTtlSeconds * 1000)})`),
        h('td', {}, t.warm ? `${t.warm.min}–${t.warm.max}` : '—'),
        h('td', {}, t.volumes.length || '—')), 'No templates.');
    },
  };
}

function volumesPage(main) {
  const tbody = h('tbody');
  const [all, toggle] = scopeToggle('volumes-all');
  main.append(h('h1', {}, 'Volumes'), h('p', {}, toggle),
    table('volumes', ['Name', 'Volume', 'State', 'Pool', 'Node', 'Size', 'Device', 'Attached to'], tbody));
  return {
    async refresh() {
      const page = await call('sandboxVolumes.list', { tenantId: tenant(), scope: all.checked ? 'all' : 'mine' });
      rows(tbody, page.items, (v) => h('tr', { 'data-id': v.id },
        h('td', {}, v.name),
        h('td', { class: 'mono' }, v.id),
        h('td', {}, stateBadge(v.state)),
        h('td', { class: 'mono' }, v.poolId),
        h('td', { class: 'mono' }, v.nodeId),
        h('td', {}, `${v.sizeGib} GiB`),
        h('td', { class: 'mono' }, `/dev/disk/by-id/virtio-${v.serial}`),
        h('td', { class: 'mono' }, v.attachedTo.join(', ') || '—')), 'No volumes.');
    },
  };
}

// ---- live events ----------------------------------------------------------------------------

// The stream takes its token as a header, which EventSource cannot send: read it with fetch.
function eventsPage(main) {
  const tbody = h('tbody');
  const status = h('span', { id: 'events-status', class: 'note' }, 'connecting…');
  main.append(h('h1', {}, 'Events ', status),
    h('p', { class: 'note' }, `The tenant's log as it is appended, newest first (the last ${EVENTS_KEPT}).`),
    table('event-log', ['Time', 'Event', 'Subject', 'Actor', 'Data'], tbody));
  const abort = new AbortController();
  const kept = [];
  let drawn = false;
  const draw = () => {
    drawn = false;
    rows(tbody, kept.slice().reverse(), (e) => h('tr', {},
      h('td', { class: 'time' }, when(e.time)),
      h('td', { class: 'mono type' }, e.type),
      h('td', { class: 'mono' }, e.subject),
      h('td', { class: 'mono' }, e.actor || ''),
      h('td', { class: 'mono data' }, summary(e.data))), 'Nothing yet.');
  };
  const received = (event) => {
    kept.push(event);
    if (kept.length > EVENTS_KEPT) kept.splice(0, kept.length - EVENTS_KEPT);
    if (!drawn) {
      drawn = true;
      setTimeout(draw, 100);
    }
  };
  follow(abort.signal, received, (text) => { status.textContent = text; });
  draw();
  return { leave: () => abort.abort() };
}

async function follow(signal, received, status) {
  let after = '';
  while (!signal.aborted) {
    try {
      const response = await fetch(`/api/compute/events/stream${after ? `?after=${encodeURIComponent(after)}` : ''}`, {
        headers: { Authorization: `Bearer ${session.token}`, Accept: 'text/event-stream' },
        signal,
      });
      if (!response.ok) {
        const answer = await response.json().catch(() => ({}));
        throw new ApiError(answer.code || `HTTP_${response.status}`, answer.message || response.statusText, response.status);
      }
      status('live');
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer = (buffer + value).replace(/\r\n?/g, '\n');
        let end;
        while ((end = buffer.indexOf('\n\n')) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const message = parseSse(block);
          if (message.id) after = message.id;
          if (message.data) received(JSON.parse(message.data));
        }
      }
      status('reconnecting…');
    } catch (e) {
      if (signal.aborted) return;
      status(`disconnected (${e.message}); retrying…`);
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function parseSse(block) {
  const message = { data: '' };
  for (const line of block.split('\n')) {
    if (!line || line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const name = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (name === 'data') message.data += (message.data ? '\n' : '') + value;
    else if (name === 'id' || name === 'event') message[name] = value;
  }
  return message;
}

// ---- usage ----------------------------------------------------------------------------------

const USAGE_DAYS = 7;
const USAGE_REFRESH_MS = 30000;

function usagePage(main) {
  const charts = h('div', { id: 'usage-charts' });
  main.append(h('h1', {}, 'Usage'),
    h('p', { class: 'note' }, `Recorded usage per day (UTC) over the last ${USAGE_DAYS} days, one chart per meter.`),
    charts);
  let last = 0;
  return {
    async refresh() {
      if (Date.now() - last < USAGE_REFRESH_MS) return;
      last = Date.now();
      const today = new Date();
      today.setUTCHours(0, 0, 0, 0);
      const days = Array.from({ length: USAGE_DAYS }, (_, i) => new Date(today - (USAGE_DAYS - 1 - i) * 86400000));
      const to = new Date(+today + 86400000);
      const sums = new Map(); // meter -> {unit, perDay: Map(day -> quantity)}
      let cursor;
      for (let pages = 0; pages < 100; pages++) {
        const page = await call('usage.list', { tenantId: tenant(), from: days[0].toISOString(), to: to.toISOString(), limit: 1000, cursor });
        for (const item of page.items) {
          const day = item.windowStart.slice(0, 10);
          const meter = sums.get(item.meter) || { unit: item.unit, perDay: new Map() };
          meter.perDay.set(day, (meter.perDay.get(day) || 0) + Number(item.quantity));
          sums.set(item.meter, meter);
        }
        cursor = page.cursor;
        if (!cursor || !page.items.length) break;
      }
      const keys = days.map((d) => d.toISOString().slice(0, 10));
      charts.replaceChildren(...(sums.size
        ? [...sums.entries()].sort().map(([meter, m], i) => usageChart(meter, m, keys, i))
        : [h('p', { class: 'note' }, 'No usage recorded in these days.')]));
    },
  };
}

// Enough digits to tell small quantities (a few seconds of a vCPU) from none.
function quantity(value) {
  if (value >= 100) return value.toFixed(0);
  if (value >= 1) return value.toFixed(2);
  return value.toPrecision(2);
}

function usageChart(meter, { unit, perDay }, days, index) {
  const [width, height, top, bottom, left] = [640, 180, 18, 28, 8];
  const max = Math.max(...days.map((d) => perDay.get(d) || 0), 1e-9);
  const slot = (width - left * 2) / days.length;
  const bars = days.flatMap((day, i) => {
    const value = perDay.get(day) || 0;
    const barHeight = ((height - top - bottom) * value) / max;
    const x = left + i * slot + slot * 0.15;
    const y = height - bottom - barHeight;
    return [
      svg('rect', { x, y, width: slot * 0.7, height: Math.max(barHeight, value ? 1 : 0), class: `m${index % 6}` },
        svg('title', {}, `${day}: ${value.toFixed(3)} ${unit}`)),
      svg('text', { x: x + slot * 0.35, y: y - 4, 'text-anchor': 'middle', class: 'bar-label' }, value ? quantity(value) : ''),
      svg('text', { x: x + slot * 0.35, y: height - 10, 'text-anchor': 'middle', class: 'axis' }, day.slice(5)),
    ];
  });
  return h('section', { class: 'card chart', 'data-meter': meter },
    h('h2', {}, meter, ' ', h('span', { class: 'note' }, `(${unit})`)),
    svg('svg', { width, height, viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': `${meter} per day` },
      svg('line', { x1: left, x2: width - left, y1: height - bottom, y2: height - bottom, stroke: '#c3ccd7' }),
      bars));
}

// ---- start ----------------------------------------------------------------------------------

const PAGES = {
  instances: instancesPage,
  sandboxes: sandboxesPage,
  templates: templatesPage,
  volumes: volumesPage,
  events: eventsPage,
  usage: usagePage,
};

window.addEventListener('hashchange', route);
document.getElementById('sign-out').addEventListener('click', () => {
  session.clear();
  location.hash = '';
  route();
});
route();
setTimeout(loop, REFRESH_MS);
