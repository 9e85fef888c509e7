// The orbit-events admin console: a page of this node over its own HTTP API
// (docs/http-api.md). Plain JavaScript, no build step. The token lives in
// sessionStorage only and is sent as `Authorization: Bearer` to this origin;
// pages are addressed by the URL fragment, which never leaves the browser.
'use strict';

const TOKEN_KEY = 'orbit-events.token';
const REFRESH_MS = 2000;
const app = document.getElementById('app');
const nav = document.getElementById('nav');
let refreshTimer = null;
// Aborted when the admin navigates or signs out: a page's requests, and
// the renders waiting on them, end with it.
let navigation = new AbortController();

// ---- The API -------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message, requestId) {
    super(message);
    this.status = status;
    this.code = code;
    this.requestId = requestId;
  }
}

// One numeric token as the node sent it (JSON.parse's source text), so
// an event's `1E400` or 30-digit integer is shown as published.
class RawNumber {
  constructor(text) { this.text = text; }
}

function parseExact(text) {
  return JSON.parse(text, (key, value, context) =>
    (typeof value === 'number' && context && context.source !== undefined ? new RawNumber(context.source) : value));
}

// JSON text of `value` indented by two spaces, numbers exactly as parsed.
function exactJson(value, indent = '') {
  const next = indent + '  ';
  if (value instanceof RawNumber) return value.text;
  if (Array.isArray(value)) {
    if (!value.length) return '[]';
    return '[\n' + value.map((v) => next + exactJson(v, next)).join(',\n') + '\n' + indent + ']';
  }
  if (value && typeof value === 'object') {
    const keys = Object.keys(value);
    if (!keys.length) return '{}';
    return '{\n' + keys.map((k) => next + JSON.stringify(k) + ': ' + exactJson(value[k], next)).join(',\n') + '\n' + indent + '}';
  }
  return JSON.stringify(value);
}

// The API: `data` of the envelope; with `exact`, [data, data with every
// number kept as its source text].
async function api(method, path, body, idempotencyKey, exact) {
  const headers = { Authorization: 'Bearer ' + sessionStorage.getItem(TOKEN_KEY) };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  if (idempotencyKey) headers['Idempotency-Key'] = idempotencyKey;
  let res;
  let text;
  try {
    res = await fetch(path, {
      method, headers, cache: 'no-store', credentials: 'omit', signal: navigation.signal,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    text = await res.text();
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, 'NETWORK', 'the node did not answer (' + e.message + ')');
  }
  let envelope = null;
  try { envelope = JSON.parse(text); } catch (_) { /* not an envelope */ }
  if (!res.ok) {
    const err = (envelope && envelope.error) || {};
    throw new ApiError(res.status, err.code || 'HTTP_' + res.status,
      err.message || res.statusText, envelope && envelope.request_id);
  }
  const data = envelope ? envelope.data : null;
  return exact ? [data, parseExact(text).data] : data;
}

// An Idempotency-Key per user action: 128 random bits (getRandomValues works
// on a plain-HTTP origin too, where crypto.randomUUID does not).
function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return 'console-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

// Wires `button` to run `write(key)` once per user action: the key is kept
// until an answer settles the action, so a double click or a retry after a
// lost answer sends the same key and the node acts once.
function onAction(button, write, errors) {
  let key = null;
  button.addEventListener('click', async () => {
    if (button.disabled) return;
    key = key || newKey();
    button.disabled = true;
    fill(errors);
    try {
      await write(key);
      key = null;
    } catch (e) {
      if (e.name === 'AbortError') return;
      fill(errors, errorBox(e));
      // A definite refusal ends the action; an unknown outcome keeps the key.
      if (e.status >= 400 && e.status < 500) key = null;
    } finally {
      button.disabled = false;
    }
  });
}

// ---- Rendering helpers ---------------------------------------------------

// h('a', {href: '#/'}, 'text', child…): elements built from data, never
// from HTML strings.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// Replaces the children of `el` with `nodes` (nested arrays flattened;
// null, undefined and false skipped).
function fill(el, ...nodes) {
  el.replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== false)
    .map((n) => (n instanceof Node ? n : document.createTextNode(String(n)))));
}

function errorBox(e) {
  let text = e.message;
  if (e.code === 'UNAVAILABLE') text = 'The node\u2019s database is unavailable (unreachable, or refusing writes, e.g. a full disk): ' + e.message;
  if (e.code === 'UNAUTHENTICATED') text = e.message + ' — sign in with a valid token.';
  if (e.code === 'STATE_CONFLICT') text = e.message + ' — it changed since this page read it; reload to see it now.';
  return h('div', { class: 'error', role: 'alert' },
    h('code', {}, e.code), ' ', text,
    e.requestId ? h('span', { class: 'muted' }, ' (request ', h('code', {}, e.requestId), ')') : null);
}

function page(title, crumbs, ...body) {
  fill(app,
    crumbs.length ? h('div', { class: 'crumbs' }, crumbs.map((c, i) => [i ? ' / ' : '', c])) : null,
    h('h1', {}, title), ...body);
}

const link = (href, text) => h('a', { href }, text);
const badge = (text, cls, title) => h('span', { class: 'badge ' + cls, title }, text);
const stateBadge = (s) => badge(s, 'state-' + s);
const fact = (name, value) => h('div', {}, h('b', {}, name), value);
const when = (t) => (t ? new Date(t).toLocaleString() : '—');
const age = (s) => (s === undefined || s === null ? '—'
  : s < 90 ? s.toFixed(1) + ' s' : s < 5400 ? (s / 60).toFixed(1) + ' min' : (s / 3600).toFixed(1) + ' h');

function table(headers, rows, numeric) {
  return h('table', {},
    h('thead', {}, h('tr', {}, headers.map((t, i) => h('th', { class: numeric && numeric.includes(i) ? 'num' : null }, t)))),
    h('tbody', {}, rows.length ? rows.map((r) => h('tr', {}, r.map((c, i) =>
      h('td', { class: numeric && numeric.includes(i) ? 'num' : null }, c))))
      : h('tr', {}, h('td', { colspan: headers.length, class: 'muted' }, 'None.'))));
}

function blockedBadges(blocked) {
  if (!blocked || !blocked.length) return badge('moving', 'ok');
  return blocked.map((b) => badge(b.code, b.code === 'EXPIRED_DELIVERIES' || b.code === 'NO_CONSUMER' ? 'warn' : 'bad', b.message));
}

// Runs `load` now and again REFRESH_MS after each run ends, while the page
// is shown: never two at once, so a slow node is not asked twice.
function every(load) {
  const signal = navigation.signal;
  const tick = async () => {
    await load();
    if (!signal.aborted) refreshTimer = setTimeout(tick, REFRESH_MS);
  };
  tick();
}

// A failed refresh: a revoked or wrong token goes back to sign-in (the
// page's address kept); anything else is shown in `into`.
function failed(into, e) {
  if (e.name === 'AbortError') return;
  if (e.code === 'UNAUTHENTICATED') {
    sessionStorage.removeItem(TOKEN_KEY);
    route(e);
    return;
  }
  fill(into, errorBox(e));
}

// ---- Pages ---------------------------------------------------------------

function signIn(failure) {
  fill(nav);
  const input = h('input', { type: 'password', id: 'token', autocomplete: 'off', placeholder: 'oe_…', 'aria-label': 'Token' });
  const button = h('button', { id: 'sign-in' }, 'Sign in');
  const errors = h('div', { id: 'errors' }, failure ? errorBox(failure) : null);
  const go = async () => {
    const token = input.value.trim();
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    input.value = '';
    button.disabled = true;
    try {
      await api('GET', '/v1/queues');
      route();
    } catch (e) {
      sessionStorage.removeItem(TOKEN_KEY);
      fill(errors, errorBox(e));
    } finally {
      button.disabled = false;
    }
  };
  button.addEventListener('click', go);
  input.addEventListener('keydown', (ev) => { if (ev.key === 'Enter') go(); });
  page('Sign in', [],
    h('p', { class: 'muted' }, 'Paste a token with events:read (and events:manage to pause, resume and retry), e.g. from ',
      h('code', {}, 'orbit-events bootstrap … --event-access'), '. It is kept in this tab only.'),
    h('div', { class: 'row' }, input, button), errors);
  input.focus();
}

async function queuesPage() {
  const data = await api('GET', '/v1/queues');
  page('Queues', [],
    h('p', { class: 'muted' }, 'The queues of this token\u2019s scope.'),
    table(['Queue', 'Id', 'Head', 'Retention floor'], data.items.map((q) => [
      link('#/queue/' + q.id, q.name), h('span', { class: 'id' }, q.id), q.head_sequence, q.retention_floor]), [2, 3]));
}

async function queuePage(queueId) {
  const body = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  page('Subscriptions', [link('#/', 'Queues'), h('span', { class: 'id' }, queueId)],
    h('p', { class: 'muted' }, 'Refreshed every 2 s.'), body);
  every(async () => {
    try {
      const list = await api('GET', '/v1/subscriptions?queue_id=' + encodeURIComponent(queueId) + '&limit=100');
      const statuses = await Promise.all(list.items.map((s) =>
        api('GET', '/v1/subscriptions/' + s.id + '/status')));
      fill(body, table(
        ['Subscription', 'Enabled', 'Lag', 'Backlog / max', 'Expired', 'Oldest unacked', 'Sessions', 'Why'],
        list.items.map((s, i) => {
          const st = statuses[i];
          return [link('#/subscription/' + s.id, s.name), st.enabled ? 'yes' : badge('paused', 'bad'),
            st.lag, st.pending_count + ' / ' + st.max_pending, st.expired,
            st.oldest_unacked ? age(st.oldest_unacked.age_seconds) : '—', st.sessions.length,
            h('span', { class: 'blocked', 'data-subscription': s.id }, blockedBadges(st.blocked))];
        }), [2, 3, 4, 5, 6]),
        list.next_cursor ? h('p', { class: 'muted' }, 'The first 100 subscriptions are shown.') : null);
    } catch (e) { failed(body, e); }
  });
}

async function subscriptionPage(subId, state) {
  const sub = await api('GET', '/v1/subscriptions/' + subId);
  const status = h('div', { id: 'status' }, h('p', { class: 'muted' }, 'Loading…'));
  const errors = h('div', {});
  const reason = h('input', { id: 'reason', class: 'wide', placeholder: 'Why (kept in the audit record)' });
  const toggle = h('button', { id: 'toggle', class: sub.enabled ? 'danger' : null }, sub.enabled ? 'Pause' : 'Resume');
  onAction(toggle, async (key) => {
    if (!reason.value.trim()) throw new ApiError(400, 'INVALID_ARGUMENT', 'give a reason');
    // The revision read with this page: a change made meanwhile answers
    // STATE_CONFLICT and is shown, never overwritten.
    await api('POST', '/v1/subscriptions/' + subId + ':configure',
      { expected_revision: sub.revision, enabled: !sub.enabled, reason: reason.value.trim() }, key);
    route();
  }, errors);
  const deliveries = h('div', {});
  const filter = h('select', { id: 'state-filter', 'aria-label': 'State' },
    ['', 'PENDING', 'LEASED', 'ACKED', 'EXPIRED'].map((s) => h('option', { value: s, selected: s === (state || '') }, s || 'every state')));
  filter.addEventListener('change', () => { location.hash = '#/subscription/' + subId + (filter.value ? '/' + filter.value : ''); });
  page(sub.name, [link('#/', 'Queues'), link('#/queue/' + sub.queue_id, 'Subscriptions'), h('span', { class: 'id' }, sub.id)],
    status,
    h('h2', {}, sub.enabled ? 'Pause' : 'Resume'),
    h('div', { class: 'row' }, h('div', {}, h('label', { for: 'reason' }, 'Reason'), reason), toggle),
    h('p', { class: 'muted' }, 'Revision ' + sub.revision + ' as read with this page.'), errors,
    h('h2', {}, 'Deliveries ', link('#/expired/' + subId, '· EXPIRED: retry and redrive')),
    h('div', { class: 'row' }, filter), deliveries);
  // The first page of deliveries refreshes with the status; a later page
  // stays as it was read.
  const paging = { cursor: null };
  every(async () => {
    try {
      const st = await api('GET', '/v1/subscriptions/' + subId + '/status');
      fill(status, statusCard(st));
    } catch (e) { failed(status, e); }
    if (!paging.cursor) await deliveryList(subId, state, deliveries, null, paging);
  });
}

function statusCard(st) {
  return h('div', { class: 'card' },
    h('div', { class: 'blocked' }, blockedBadges(st.blocked)),
    (st.blocked || []).map((b) => h('p', { class: 'muted' }, h('code', {}, b.code), ' ', b.message)),
    h('div', { class: 'facts' },
      fact('Enabled', st.enabled ? 'yes' : 'no'), fact('Lag', h('span', { id: 'lag' }, st.lag)),
      fact('Head', st.head_sequence), fact('Cursor', st.cursor_sequence), fact('Retention floor', st.retention_floor),
      fact('Backlog / max', st.pending_count + ' / ' + st.max_pending),
      fact('Pending · leased · expired', st.pending + ' · ' + st.leased + ' · ' + st.expired),
      fact('Oldest unacked', st.oldest_unacked ? age(st.oldest_unacked.age_seconds) + ' (seq ' + st.oldest_unacked.sequence + ')' : '—'),
      fact('Sessions', st.sessions.map((s) => s.held + '/' + s.capacity + ' held').join(', ') || 'none')),
    st.last_configure ? h('p', { class: 'muted', id: 'last-configure' },
      (st.last_configure.enabled ? 'Resumed ' : 'Paused ') + when(st.last_configure.at) + ': \u201c' +
      st.last_configure.reason + '\u201d (credential ' + st.last_configure.credential_id + ')') : null);
}

// One page of deliveries into `into`, with a button for the next (which
// records its cursor in `paging`, when given).
async function deliveryList(subId, state, into, cursor, paging) {
  let path = '/v1/subscriptions/' + subId + '/deliveries?limit=50';
  if (state) path += '&state=' + state;
  if (cursor) path += '&cursor=' + encodeURIComponent(cursor);
  try {
    const data = await api('GET', path);
    // Unchanged since the last refresh: leave the rows (and a click on
    // them) alone.
    const shown = JSON.stringify(data);
    if (into.dataset.shown === shown) return;
    into.dataset.shown = shown;
    const more = data.next_cursor ? h('button', { class: 'secondary', id: 'next-page' }, 'Next 50') : null;
    if (more) {
      more.addEventListener('click', () => {
        if (paging) paging.cursor = data.next_cursor;
        deliveryList(subId, state, into, data.next_cursor, paging);
      });
    }
    const first = cursor ? h('button', { class: 'secondary', id: 'first-page' }, 'First page') : null;
    if (first) {
      first.addEventListener('click', () => {
        if (paging) paging.cursor = null;
        deliveryList(subId, state, into, null, paging);
      });
    }
    fill(into, table(['Delivery', 'Sequence', 'State', 'Attempts', 'Created'],
      data.items.map((d) => [link('#/delivery/' + subId + '/' + d.id, h('span', { class: 'id' }, d.id)),
        d.sequence, stateBadge(d.state), d.attempts + ' / ' + d.attempt_budget, when(d.created_at)]), [1, 3]), first, more);
  } catch (e) { failed(into, e); }
}

async function deliveryPage(subId, deliveryId) {
  const base = '/v1/subscriptions/' + subId + '/deliveries/' + deliveryId;
  const [[detail, exact], history] = await Promise.all([
    api('GET', base, undefined, undefined, true), api('GET', base + '/history')]);
  const d = detail.delivery;
  const facts = h('div', { id: 'facts' });
  const steps = h('div', {});
  const errors = h('div', {});
  let retry = null;
  if (d.state === 'EXPIRED') {
    const reason = h('input', { id: 'retry-reason', class: 'wide', placeholder: 'Why it can succeed now' });
    const button = h('button', { id: 'retry' }, 'Retry with 1 more attempt');
    onAction(button, async (key) => {
      await api('POST', base + ':retry', { expected_revision: d.revision, reason: reason.value.trim(), additional_attempts: 1 }, key);
      route();
    }, errors);
    retry = [h('h2', {}, 'Retry'), h('div', { class: 'row' }, reason, button), errors];
  }
  const show = (delivery, items) => {
    fill(facts, deliveryCard(delivery));
    fill(steps, timeline(delivery, items));
  };
  show(d, history.items);
  page('Delivery', [link('#/', 'Queues'), link('#/subscription/' + subId, 'Subscription'), h('span', { class: 'id' }, d.id)],
    facts, retry, h('h2', {}, 'Timeline'), steps,
    h('h2', {}, 'Event ', h('span', { class: 'muted' }, '(as published, byte for byte in its numbers)')),
    h('pre', { id: 'event' }, exactJson(exact.event)));
  // State and timeline follow the delivery (a retry, a new lease), from
  // one refresh period on, unless the admin has moved on by then.
  const signal = navigation.signal;
  refreshTimer = setTimeout(() => {
    if (signal.aborted) return;
    every(async () => {
      try {
        const [now, later] = await Promise.all([api('GET', base), api('GET', base + '/history')]);
        show(now.delivery, later.items);
      } catch (e) { failed(facts, e); }
    });
  }, REFRESH_MS);
}

function deliveryCard(d) {
  return h('div', { class: 'card' }, h('div', { class: 'facts' },
    fact('State', stateBadge(d.state)), fact('Sequence', d.sequence), fact('Attempts', d.attempts + ' / ' + d.attempt_budget),
    fact('Lease epoch', d.lease_epoch), fact('Revision', d.revision), fact('Created', when(d.created_at)),
    fact('Available', when(d.available_at)), d.lease_until ? fact('Lease until', when(d.lease_until)) : null,
    d.acknowledged_at ? fact('Acknowledged', when(d.acknowledged_at)) : null));
}

function timeline(d, steps) {
  const items = steps.map((s) => {
    const { step, at, ...rest } = s;
    return h('li', { class: 'step-' + step }, h('b', {}, step), h('span', { class: 'when' }, when(at)),
      h('div', { class: 'detail' }, Object.entries(rest).map(([k, v]) => k + ' ' + v).join(' · ')));
  });
  if (d.acknowledged_at && !steps.some((s) => s.step === 'ACKED')) {
    items.push(h('li', { class: 'step-ACKED' }, h('b', {}, 'ACKED'), h('span', { class: 'when' }, when(d.acknowledged_at))));
  }
  return h('ol', { class: 'timeline', id: 'timeline' }, items);
}

async function expiredPage(subId) {
  const sub = await api('GET', '/v1/subscriptions/' + subId);
  const list = h('div', {});
  const errors = h('div', { id: 'redrive-errors' });
  const outcome = h('div', { id: 'redrive-outcome' });
  const reason = h('input', { id: 'redrive-reason', class: 'wide', placeholder: 'Why they can succeed now' });
  const attempts = h('input', { id: 'redrive-attempts', type: 'number', min: 1, max: 100, value: 1 });
  const from = h('input', { id: 'redrive-from', placeholder: 'first', size: 10 });
  const to = h('input', { id: 'redrive-to', placeholder: 'last', size: 10 });
  const count = h('button', { id: 'redrive-count', class: 'secondary' }, 'Count (dry run)');
  const request = (dryRun) => {
    const body = { reason: reason.value.trim(), additional_attempts: Number(attempts.value), limit: 10000, dry_run: dryRun };
    if (from.value.trim()) body.from_sequence = from.value.trim();
    if (to.value.trim()) body.to_sequence = to.value.trim();
    return body;
  };
  for (const field of [reason, attempts, from, to]) field.addEventListener('input', () => fill(outcome));
  onAction(count, async (key) => {
    fill(outcome);
    const body = request(true);
    const dry = await api('POST', '/v1/subscriptions/' + subId + '/deliveries:retry', body, key);
    if (!dry.matched) { fill(outcome, h('p', { class: 'notice' }, 'No EXPIRED delivery in that range.')); return; }
    // The confirm button carries exactly the request that was counted.
    const confirm = h('button', { id: 'redrive-confirm', class: 'danger' }, 'Re-arm ' + dry.matched + ' deliveries');
    onAction(confirm, async (realKey) => {
      const done = await api('POST', '/v1/subscriptions/' + subId + '/deliveries:retry', { ...body, dry_run: false }, realKey);
      fill(outcome, h('p', { class: 'notice', id: 'redrive-done' },
        'Re-armed ' + done.retried + ' of ' + done.matched + ' (sequences ' + done.first_sequence + '–' + done.last_sequence + ').'));
      await deliveryList(subId, 'EXPIRED', list, null);
    }, errors);
    fill(outcome, h('p', { id: 'redrive-matched' }, dry.matched + ' EXPIRED deliveries match (sequences ' +
      dry.first_sequence + '–' + dry.last_sequence + '). Nothing is changed until you confirm.'), confirm);
  }, errors);
  page('EXPIRED deliveries of ' + sub.name, [link('#/', 'Queues'), link('#/subscription/' + subId, sub.name), 'EXPIRED'],
    h('p', { class: 'muted' }, 'Out of attempts. Open one to retry it alone, or re-arm a range below: the dry run counts them first.'),
    h('h2', {}, 'Redrive'),
    h('div', { class: 'row' },
      h('div', {}, h('label', { for: 'redrive-reason' }, 'Reason'), reason),
      h('div', {}, h('label', { for: 'redrive-attempts' }, 'More attempts'), attempts),
      h('div', {}, h('label', { for: 'redrive-from' }, 'From sequence'), from),
      h('div', {}, h('label', { for: 'redrive-to' }, 'To sequence'), to), count),
    errors, outcome, h('h2', {}, 'EXPIRED now'), list);
  await deliveryList(subId, 'EXPIRED', list, null);
}

// ---- Routing -------------------------------------------------------------

// Renders the page the address names. `failure`: why the token was just
// dropped (the sign-in page says it).
async function route(failure) {
  clearTimeout(refreshTimer);
  refreshTimer = null;
  navigation.abort();
  navigation = new AbortController();
  if (!sessionStorage.getItem(TOKEN_KEY)) return signIn(failure instanceof ApiError ? failure : null);
  const signOut = h('button', { id: 'sign-out', class: 'right' }, 'Sign out');
  signOut.addEventListener('click', () => { sessionStorage.removeItem(TOKEN_KEY); location.hash = '#/'; route(); });
  fill(nav, link('#/', 'Queues'), signOut);
  fill(app, h('p', { class: 'muted' }, 'Loading…'));
  const [, name, a, b] = location.hash.replace(/^#\/?/, '/').split('/');
  try {
    if (name === 'queue' && a) await queuePage(a);
    else if (name === 'subscription' && a) await subscriptionPage(a, b);
    else if (name === 'delivery' && a && b) await deliveryPage(a, b);
    else if (name === 'expired' && a) await expiredPage(a);
    else await queuesPage();
  } catch (e) {
    if (e.name === 'AbortError') return;
    if (e.code === 'UNAUTHENTICATED') { sessionStorage.removeItem(TOKEN_KEY); return signIn(e); }
    const again = h('button', { class: 'secondary', id: 'try-again' }, 'Try again');
    again.addEventListener('click', () => route());
    page('Something failed', [link('#/', 'Queues')], errorBox(e), again);
  }
}

window.addEventListener('hashchange', () => route());
route();
