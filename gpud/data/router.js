// gpud's router: route an OpenAI request by its body's `model` (docs/router.md).
// Runs in the front's nginx (njs 0.7.9, Debian 12's libnginx-mod-http-js). CONFIG, above, is
// the table gpud renders (gpud/core/router.py); this file is gpud/data/router.js.
//
// njs facts used (https://nginx.org/en/docs/njs/reference.html): a js_content handler runs
// once the request body is read; r.requestBuffer is the body while it is in memory (the
// server's client_body_buffer_size holds it: max_body_mib); r.internalRedirect('@name')
// goes to a named location, the body kept; r.variables.NAME sets a js_var;
// r.subrequest(uri, options) returns a Promise of the reply (status, headersOut,
// responseText), read whole into memory (njs 0.7.9 gives every subrequest with a callback
// NGX_HTTP_SUBREQUEST_IN_MEMORY, nginx/ngx_http_js_module.c ngx_http_js_subrequest; a
// detached one's answer is dropped): it cannot carry a stream. r.sendHeader(), r.send() and
// r.finish() answer from the script itself; r.internalRedirect() takes effect once nothing
// of the script is pending (ngx_http_js_content_finalize), so after a subrequest's answer too.

import crypto from 'crypto';

function fail(r, status, message, code, param) {
    r.headersOut['Content-Type'] = 'application/json';
    var type = status >= 500 ? 'server_error' : 'invalid_request_error';
    r.return(status, JSON.stringify({error: {message: message, type: type,
                                             param: param === undefined ? null : param,
                                             code: code}}));
}

// The `model` field of a multipart form (the audio routes): the part named "model".
function formModel(body) {
    var at = body.indexOf('name="model"');
    if (at < 0) {
        return undefined;
    }
    var start = body.indexOf('\r\n\r\n', at);
    if (start < 0) {
        return undefined;
    }
    start += 4;
    var end = body.indexOf('\r\n', start);
    if (end < 0) {
        return undefined;
    }
    return body.slice(start, end).toString();
}

// Bodies from this size on are looked through for their `model` key before being parsed:
// njs's JSON.parse of a large body (an image in base64) costs tens of milliseconds.
var SCAN_FROM = 65536;

function space(c) {
    return c === 0x20 || c === 0x0a || c === 0x0d || c === 0x09;
}

// The value of the one `"model": "..."` in a large JSON body, or undefined when there is not
// exactly one (or it is not a plain string): then the body is parsed. An unescaped "model"
// followed by ':' is a key (inside a JSON string a quote is escaped); when the body has one
// such key, it is the top-level one.
function scanModel(body) {
    var start = 0, found, count = 0, at, i, end;
    while (start < body.length && space(body[start])) {
        start++;
    }
    if (body[start] !== 0x7b) {
        return undefined;
    }
    for (at = body.indexOf('"model"'); at >= 0; at = body.indexOf('"model"', at + 7)) {
        for (i = at + 7; i < body.length && space(body[i]); i++) {}
        if (body[i] !== 0x3a) {
            continue;
        }
        for (i++; i < body.length && space(body[i]); i++) {}
        count++;
        found = undefined;
        if (body[i] === 0x22) {
            end = body.indexOf('"', i + 1);
            if (end > i && end - i <= 256) {
                found = body.slice(i + 1, end).toString();
                if (found.indexOf('\\') >= 0) {
                    found = undefined;
                }
            }
        }
    }
    return count === 1 ? found : undefined;
}

// Whether a large body's one `"stream"` key is `true` (as scanModel: not parsed).
function scanStream(body) {
    var count = 0, value = false, at, i;
    for (at = body.indexOf('"stream"'); at >= 0; at = body.indexOf('"stream"', at + 8)) {
        for (i = at + 8; i < body.length && space(body[i]); i++) {}
        if (body[i] !== 0x3a) {
            continue;
        }
        for (i++; i < body.length && space(body[i]); i++) {}
        count++;
        value = body.slice(i, i + 4).toString() === 'true';
    }
    return count === 1 && value;
}

function levenshtein(a, b) {
    var prev = [], cur, i, j;
    for (j = 0; j <= b.length; j++) {
        prev.push(j);
    }
    for (i = 1; i <= a.length; i++) {
        cur = [i];
        for (j = 1; j <= b.length; j++) {
            cur.push(Math.min(prev[j] + 1, cur[j - 1] + 1,
                              prev[j - 1] + (a[i - 1] === b[j - 1] ? 0 : 1)));
        }
        prev = cur;
    }
    return prev[b.length];
}

// Up to three names KEY may use close to NAME: one contains the other, or a few edits away.
function closeNames(name, key) {
    var low = name.toLowerCase().slice(0, 256), found = [];
    Object.keys(CONFIG.models).filter(function (known) {
        return allows(key, known);
    }).forEach(function (known) {
        var k = known.toLowerCase();
        var d = levenshtein(low, k);
        if (k.indexOf(low) >= 0 || low.indexOf(k) >= 0 || d <= Math.max(2, k.length / 3)) {
            found.push([d, known]);
        }
    });
    found.sort(function (x, y) { return x[0] - y[0] || (x[1] < y[1] ? -1 : 1); });
    return found.slice(0, 3).map(function (x) { return x[1]; });
}

// With router.api_keys_file: the request's key (its name and models), or null once answered
// 401. Without: {models: ['*']}. Tokens are compared by their SHA-256 (the table holds
// nothing else).
function keyOf(r) {
    if (CONFIG.keys === null) {
        return {name: null, models: ['*']};
    }
    var auth = r.headersIn['Authorization'] || '';
    var m = auth.match(/^Bearer\s+(\S+)\s*$/i);
    var key = m ? CONFIG.keys[crypto.createHash('sha256').update(m[1]).digest('hex')] : undefined;
    if (key === undefined) {
        r.headersOut['WWW-Authenticate'] = 'Bearer';
        fail(r, 401, m ? 'Incorrect API key provided' :
             'No API key provided (Authorization: Bearer KEY)', 'invalid_api_key');
        return null;
    }
    return key;
}

function allows(key, model) {
    return key.models.indexOf('*') >= 0 || key.models.indexOf(model) >= 0;
}

function route(r) {
    var key = keyOf(r);
    if (key === null) {
        return;
    }
    if (r.method !== 'POST') {
        r.headersOut['Allow'] = 'POST';
        fail(r, 405, 'method ' + r.method + ' not allowed on ' + r.uri + ' (POST)',
             'method_not_allowed');
        return;
    }
    var body = r.requestBuffer;
    if (body === undefined || body.length === 0) {
        fail(r, 400, 'the request has no body: a JSON object with a "model" is expected',
             'missing_model', 'model');
        return;
    }
    var type = (r.headersIn['Content-Type'] || '').toLowerCase();
    // stream: true, false, or null when a large body was not parsed (looked through for
    // "stream" only when it matters: each look through 900 KiB costs njs about 2 ms)
    var model, stream = false;
    if (type.indexOf('multipart/form-data') === 0) {
        model = formModel(body);
    } else if (body.length >= SCAN_FROM && (model = scanModel(body)) !== undefined) {
        // found without parsing (a malformed large body is the serve's to refuse)
        stream = null;
    } else {
        var doc;
        try {
            doc = JSON.parse(body.toString());
        } catch (e) {
            fail(r, 400, 'the request body is not valid JSON: ' + e.message, 'invalid_json');
            return;
        }
        if (doc === null || typeof doc !== 'object' || Array.isArray(doc)) {
            fail(r, 400, 'the request body is not a JSON object', 'invalid_json');
            return;
        }
        model = doc.model;
        stream = doc.stream === true;
    }
    if (model === undefined || model === null) {
        fail(r, 400, 'the request names no "model"', 'missing_model', 'model');
        return;
    }
    if (typeof model !== 'string') {
        fail(r, 400, '"model" must be a string', 'invalid_model', 'model');
        return;
    }
    var entry = CONFIG.models.hasOwnProperty(model) ? CONFIG.models[model] : undefined;
    if (entry === undefined) {
        var close = closeNames(model, key);
        fail(r, 404, 'The model ' + JSON.stringify(model) + ' does not exist on this endpoint' +
             (close.length ? '; did you mean ' + close.map(function (n) {
                 return JSON.stringify(n); }).join(', ') + '?' : '') +
             ' (GET /v1/models lists them)', 'model_not_found', 'model');
        return;
    }
    if (!allows(key, model)) {
        fail(r, 403, 'key ' + key.name + ' may not use model ' + JSON.stringify(model),
             'model_not_allowed', 'model');
        return;
    }
    r.variables.router_model = model;
    r.variables.router_serve = entry.serve;
    r.variables.router_key = key.name || '';
    if (entry.ensure && CONFIG.loading_feedback_s > 0 &&
            (stream === null ? scanStream(body) : stream)) {
        // through the key's limits first (@router_loading), then loading(): loadingStream
        r.internalRedirect('@router_loading');
        return;
    }
    r.internalRedirect(entry.location);
}

// The 503 of a refusal: gpud's reason (its X-Gpud-Reason, OpenAI's error shape) under
// error.gpud.
function refusal(r, reason) {
    var message = 'refused by gpud', details = null;
    try {
        var doc = JSON.parse(reason);
        message = doc.error.message;
        details = doc.error;
    } catch (e) {
        // no reason given
    }
    return {error: {
        message: 'model ' + JSON.stringify(r.variables.router_model) + ' (serve ' +
                 r.variables.router_serve + ') cannot be brought up: ' + message,
        type: 'server_error', param: null, code: 'model_unavailable', gpud: details}};
}

// Loading feedback (docs/router.md): a stream for a serve gpud may have to bring up. The
// script asks gpud itself (the ensure the serve's location would ask). Past the first
// second without an answer, it answers 200 text/event-stream and sends an SSE comment
// (`: loading MODEL`) every loading_feedback_s, which SSE clients ignore and which keeps
// theirs and any proxy's read timeouts from firing through a cold start. Once gpud answers:
// - nothing sent yet: the request goes on to its serve as any other (its status is the
//   serve's, a refusal the usual 503 with Retry-After);
// - the stream begun, the serve up (or gpud unreachable: as the auth_request's 500): the
//   serve's answer is included in the stream by nginx's SSI, a subrequest whose answer
//   nginx streams through as it comes (a script's own subrequest is read whole);
// - the stream begun, gpud refused: an error event in OpenAI's shape, then [DONE].
function loading(r, model, entry) {
    var began = Date.now(), sent = false, timer;
    function tick() {
        if (!sent) {
            sent = true;
            r.variables.router_sse = 'stream';
            r.status = 200;
            r.headersOut['Content-Type'] = 'text/event-stream';
            r.headersOut['Cache-Control'] = 'no-cache';
            r.sendHeader();
        }
        r.send(': loading ' + model + '\n\n');
        timer = setTimeout(tick, CONFIG.loading_feedback_s * 1000);
    }
    timer = setTimeout(tick, Math.min(1000, CONFIG.loading_feedback_s * 1000));
    r.subrequest(CONFIG.ensure_prefix + entry.serve, {method: 'POST'}).then(function (reply) {
        clearTimeout(timer);
        r.variables.router_ensure_s = ((Date.now() - began) / 1000).toFixed(3);
        if (reply.status === 403) {
            var doc = refusal(r, reply.headersOut['X-Gpud-Reason']);
            if (!sent) {
                r.headersOut['Retry-After'] = reply.headersOut['Retry-After'] ||
                    String(CONFIG.retry_after_s);
                r.headersOut['Content-Type'] = 'application/json';
                r.return(503, JSON.stringify(doc));
                return;
            }
            r.variables.router_sse = 'refused';
            r.send('data: ' + JSON.stringify(doc) + '\n\ndata: [DONE]\n\n');
        } else if (!sent) {
            r.internalRedirect(entry.location + '_direct');
            return;
        } else {
            r.send('<!--# include virtual="' + CONFIG.stream_prefix + entry.serve + r.uri +
                   '" -->');
        }
        r.finish();
    });
}

function states(r) {
    return r.subrequest('/.gpud-router-serves', {method: 'GET'}).then(function (reply) {
        var by = {};
        if (reply.status === 200) {
            try {
                JSON.parse(reply.responseText).serves.forEach(function (s) {
                    by[s.name] = s.state;
                });
            } catch (e) {
                // gpud's answer unreadable: every state unknown
            }
        }
        return by;
    }, function () { return {}; });
}

function entry(name, by, created) {
    var serve = CONFIG.models[name].serve;
    return {id: name, object: 'model', created: created, owned_by: 'gpud',
            gpud: {serve: serve, state: by.hasOwnProperty(serve) ? by[serve] : 'unknown'}};
}

function models(r) {
    var key = keyOf(r);
    if (key === null) {
        return;
    }
    if (r.method !== 'GET' && r.method !== 'HEAD') {
        fail(r, 405, 'method ' + r.method + ' not allowed on /v1/models (GET)',
             'method_not_allowed');
        return;
    }
    states(r).then(function (by) {
        var created = Math.floor(Date.now() / 1000);
        var data = Object.keys(CONFIG.models).sort().filter(function (name) {
            return allows(key, name);
        }).map(function (name) {
            return entry(name, by, created);
        });
        r.headersOut['Content-Type'] = 'application/json';
        r.return(200, JSON.stringify({object: 'list', data: data}));
    });
}

function model(r) {
    var key = keyOf(r);
    if (key === null) {
        return;
    }
    var name = r.uri.slice('/v1/models/'.length);
    if (!CONFIG.models.hasOwnProperty(name) || !allows(key, name)) {
        var close = closeNames(name, key);
        fail(r, 404, 'The model ' + JSON.stringify(name) + ' does not exist on this endpoint' +
             (close.length ? '; did you mean ' + close.map(function (n) {
                 return JSON.stringify(n); }).join(', ') + '?' : ''), 'model_not_found');
        return;
    }
    states(r).then(function (by) {
        r.headersOut['Content-Type'] = 'application/json';
        r.return(200, JSON.stringify(entry(name, by, Math.floor(Date.now() / 1000))));
    });
}

// gpud refused to bring the serve up (its ensure answered 403): 503 with gpud's reason.
function refused(r) {
    r.headersOut['Retry-After'] = r.variables.router_retry || String(CONFIG.retry_after_s);
    r.headersOut['Content-Type'] = 'application/json';
    r.return(503, JSON.stringify(refusal(r, r.variables.router_reason)));
}

// The serve did not answer (stopped, starting, restarting; gpud down and the serve not up).
function down(r) {
    r.headersOut['Retry-After'] = String(CONFIG.retry_after_s);
    fail(r, 503, 'model ' + JSON.stringify(r.variables.router_model || '') + ': serve ' +
         (r.variables.router_serve || '?') + ' is not running', 'model_not_running');
}

// The serve's answer to a stream that had loading feedback (a body filter of the include):
// as it comes when the serve took the request; an error answer (vLLM's 4xx: OpenAI's error
// shape, one JSON document) once whole, as an error event and [DONE], as vLLM ends a
// stream that failed. The filter's VM is the subrequest's own: `held` is this answer's.
var held = '';
function streamed(r, data, flags) {
    if (r.status < 400) {
        r.sendBuffer(data, flags);
        return;
    }
    held += data;
    var doc;
    try {
        doc = JSON.parse(held);
    } catch (e) {
        if (held.length < 65536) {
            return;
        }
        doc = {error: {message: held.slice(0, 1024), type: 'server_error', param: null,
                       code: r.status}};
    }
    held = '';
    r.sendBuffer('data: ' + JSON.stringify(doc) + '\n\ndata: [DONE]\n\n', flags);
}

// The serve did not answer a stream that had loading feedback: an error event.
function streamDown(r) {
    r.return(200, 'data: ' + JSON.stringify({error: {
        message: 'model ' + JSON.stringify(r.variables.router_model || '') + ': serve ' +
                 (r.variables.router_serve || '?') + ' is not running',
        type: 'server_error', param: null, code: 'model_not_running'}}) +
        '\n\ndata: [DONE]\n\n');
}

// A stream for a serve gpud may bring up, past its key's limits (@router_loading).
function loadingStream(r) {
    var model = r.variables.router_model;
    loading(r, model, CONFIG.models[model]);
}

// Past a key's limits (nginx's limit_conn / limit_req where the router sent the request: the
// serve's location, or @router_loading): 429 in OpenAI's shape (code rate_limit_exceeded),
// which limit and its figure, and Retry-After: a minute's share of requests_per_minute, or a
// second for max_concurrent (one of the key's requests in flight ends by then, or it is asked
// again).
function limited(r) {
    var name = r.variables.router_key || '';
    var lim = CONFIG.limits.hasOwnProperty(name) ? CONFIG.limits[name] : {};
    var which, value, retry, message;
    if (r.variables.limit_req_status === 'REJECTED') {
        which = 'requests_per_minute';
        value = lim.requests_per_minute;
        retry = Math.max(1, Math.ceil(60 / (value || 60)));
        message = 'key ' + name + ' is past its limit of ' + value + ' requests per minute';
    } else {
        which = 'max_concurrent';
        value = lim.max_concurrent;
        retry = 1;
        message = 'key ' + name + ' has ' + value + ' requests in flight, its max_concurrent';
    }
    r.headersOut['Retry-After'] = String(retry);
    r.headersOut['Content-Type'] = 'application/json';
    r.return(429, JSON.stringify({error: {
        message: message + '; retry after ' + retry + ' s', type: 'requests', param: null,
        code: 'rate_limit_exceeded',
        gpud: {key: name, limit: which, value: value, retry_after_s: retry}}}));
}

export default {route, models, model, refused, down, streamed, streamDown, loadingStream,
                limited};
