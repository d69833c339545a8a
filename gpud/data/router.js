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
//
// What runs at the top level runs again for every request, and for a serve's answer again:
// njs 0.7.9 gives each request a clone of the VM and runs the script's global code in it
// (nginx/ngx_http_js_module.c ngx_http_js_init_vm: njs_vm_clone, then njs_vm_start), and an
// internal redirect (route() to its serve's location, where the meter reads the answer)
// starts a new one. Each function declared here, each member of the default export and of
// CONFIG, each table, array or pattern made at the top level costs every request; so the
// tables of error paths are made where they are used, and a helper of one rarely taken path
// is declared inside its one caller.

import crypto from 'crypto';
import fs from 'fs';

// Whether OBJ has KEY of its own: never OBJ.hasOwnProperty(KEY), which a model (or serve)
// named "hasOwnProperty" would shadow (L1).
function has(obj, key) {
    return Object.prototype.hasOwnProperty.call(obj, key);
}

// The one place of the router's error document (OpenAI's shape: message, type, param, code).
function fail(r, status, message, code, param) {
    r.headersOut['Content-Type'] = 'application/json';
    var type = status >= 500 ? 'server_error' : 'invalid_request_error';
    r.return(status, JSON.stringify({error: {message: message, type: type,
                                             param: param === undefined ? null : param,
                                             code: code}}));
}

// The `model` field of a multipart form (the audio routes), read as the serve reads it: the
// body's parts between the delimiters of its Content-Type's boundary, the last one whose
// Content-Disposition names "model" (FastAPI reads a form field from Starlette's FormData,
// whose ImmutableMultiDict keeps a name's last value: starlette/datastructures.py). A part's
// content (an audio file) is skipped natively, never looked into.
function formModel(body, type) {
    // Whether a part's headers say it is the form field "model" (name="model" or name=model).
    function namesModel(head) {
        return head.split('\r\n').some(function (line) {
            var low = line.toLowerCase();
            if (low.indexOf('content-disposition:') !== 0) {
                return false;
            }
            return low.slice(20).split(';').slice(1).some(function (param) {
                var kv = param.trim().split('=');
                return kv.length === 2 && kv[0].trim() === 'name' &&
                    kv[1].trim().replace(/^"(.*)"$/, '$1') === 'model';
            });
        });
    }
    var m = type.match(/boundary=(?:"([^"]+)"|([^;\s]+))/i);
    if (!m) {
        return undefined;
    }
    var boundary = m[1] || m[2], delim = '\r\n--' + boundary, found, at, start, headEnd, next;
    var parts = 0;
    if (body.slice(0, boundary.length + 2).toString() === '--' + boundary) {
        at = -2;  // the first delimiter opens the body (no CRLF before it)
    } else if ((at = body.indexOf(delim)) < 0) {
        return undefined;
    }
    while (parts++ < 1000) {
        start = at + delim.length;
        if (body.slice(start, start + 2).toString() === '--') {
            break;  // the close delimiter
        }
        headEnd = body.indexOf('\r\n\r\n', start);
        next = headEnd < 0 ? -1 : body.indexOf(delim, headEnd + 4);
        if (next < 0) {
            break;
        }
        if (headEnd - start <= 4096 && namesModel(body.slice(start, headEnd).toString())) {
            found = next - headEnd - 4 <= 2048 ? body.slice(headEnd + 4, next).toString() : 0;
        }
        at = next;
    }
    return found;
}

// Bodies from this size on are walked for their top-level keys instead of parsed: njs's
// JSON.parse of a large body (an image in base64) costs tens of milliseconds, and of many
// small objects seconds (64 MiB of them: 7.6 s at 2.5 GB).
var SCAN_FROM = 65536;
// The steps a walk may take in nested values (a byte outside strings, or a string skipped
// by Buffer.indexOf, natively): past them the body is refused 413 (too_complex) rather than
// a worker held. A step costs njs 0.7.9 about 0.3 us (bench/router_body.py: 108 ms for a
// MiB of small objects walked whole), so the walk stops within about 80 ms; a chat of ten
// thousand messages takes about 100000 steps, an image in base64 one.
var SCAN_STEPS = 262144;

// The top-level keys `model` and `stream` of a JSON object in BODY, read as the serve's
// json.loads reads them (Starlette's Request.json: escapes decoded, a key given twice is its
// last value), without parsing the rest: {model, stream} (model undefined when the body
// has none), or {error: [status, message, code]}. Nested values are walked by their
// brackets (a key inside them is not the body's), strings skipped whole.
function topLevel(body) {
    // The index after the string whose opening quote is at i (-1: unterminated).
    function skipString(body, i) {
        var j = i + 1, k, slashes;
        for (;;) {
            j = body.indexOf('"', j);
            if (j < 0) {
                return -1;
            }
            for (k = j - 1, slashes = 0; body[k] === 0x5c; k--) {
                slashes++;
            }
            if (slashes % 2 === 0) {
                return j + 1;
            }
            j++;
        }
    }
    function space(c) {
        return c === 0x20 || c === 0x0a || c === 0x0d || c === 0x09;
    }
    var n = body.length, i = 0, steps = 0;
    var found = {model: undefined, stream: false, priority: []};
    var key, end, c, depth, v;
    function ws() {
        while (i < n && space(body[i])) {
            i++;
        }
    }
    function bad(what) {
        return {error: [400, 'the request body is not valid JSON: ' + what + ' at byte ' + i,
                        'invalid_json']};
    }
    if (body.indexOf(0) >= 0) {
        // UTF-16 or 32 (json.loads would detect them): the router reads UTF-8 only
        return {error: [400, 'the request body is not UTF-8 JSON (a NUL byte)', 'invalid_json']};
    }
    ws();
    if (body[i] !== 0x7b) {
        return {error: [400, 'the request body is not a JSON object', 'invalid_json']};
    }
    i++;
    ws();
    if (body[i] === 0x7d) {
        i++;
    } else {
        for (;;) {
            ws();
            if (body[i] !== 0x22) {
                return bad('a key expected');
            }
            end = skipString(body, i);
            if (end < 0) {
                return bad('an unterminated key');
            }
            key = end - i <= 64 ? body.slice(i + 1, end - 1).toString() : null;
            if (key !== null && key.indexOf('\\') >= 0) {
                try {
                    key = JSON.parse('"' + key + '"');
                } catch (e) {
                    return bad('a bad escape in a key');
                }
            }
            i = end;
            ws();
            if (body[i] !== 0x3a) {
                return bad("':' expected");
            }
            i++;
            ws();
            v = i;
            c = body[i];
            if (c === 0x22) {
                end = skipString(body, i);
                if (end < 0) {
                    return bad('an unterminated string');
                }
                i = end;
            } else if (c === 0x7b || c === 0x5b) {
                depth = 0;
                do {
                    c = body[i];
                    if (++steps > SCAN_STEPS) {
                        return {error: [413, 'the request body has more structure than the ' +
                                        'router reads (' + SCAN_STEPS + ' steps): send ' +
                                        'fewer, larger parts', 'too_complex']};
                    }
                    if (c === 0x22) {
                        end = skipString(body, i);
                        if (end < 0) {
                            return bad('an unterminated string');
                        }
                        i = end;
                        continue;
                    }
                    if (c === 0x7b || c === 0x5b) {
                        depth++;
                    } else if (c === 0x7d || c === 0x5d) {
                        depth--;
                    } else if (c === undefined) {
                        return bad('an unterminated ' + (body[v] === 0x7b ? 'object' : 'array'));
                    }
                    i++;
                } while (depth > 0);
            } else {
                while (i < n && body[i] !== 0x2c && body[i] !== 0x7d && !space(body[i])) {
                    i++;
                }
                if (i === v) {
                    return bad('a value expected');
                }
            }
            if (key === 'model') {
                if (body[v] === 0x22 && i - v <= 2048) {
                    try {
                        found.model = JSON.parse(body.slice(v, i).toString());
                    } catch (e) {
                        return bad('a bad "model" string');
                    }
                } else {
                    // not a string (or longer than any name): the usual 400 or 404
                    found.model = body[v] === 0x22 ? body.slice(v + 1, v + 2049).toString() :
                        body.slice(v, Math.min(i, v + 16)).toString() === 'null' ? null : 0;
                }
            } else if (key === 'stream') {
                found.stream = body.slice(v, i).toString() === 'true';
            } else if (key === 'priority') {
                found.priority.push([v, i]);
            } else if (key === 'stream_options') {
                found.streamOptions = true;
            }
            ws();
            if (body[i] === 0x2c) {
                i++;
                continue;
            }
            if (body[i] === 0x7d) {
                i++;
                break;
            }
            return bad("',' or '}' expected");
        }
    }
    ws();
    if (i !== n) {
        return bad('extra data after the object');
    }
    return found;
}

// Up to three names KEY may use close to NAME: one contains the other, or a few edits away.
function closeNames(name, key) {
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

// The error document (the shape fail() answers) as text: for nginx's `return` of the error
// pages, whose text comes from a js_set variable (gpud/core/router.py ERROR_PAGES): no body
// is read for them (a js_content handler would read it first).
function errorText(status, message, code) {
    return JSON.stringify({error: {message: message,
                                   type: status >= 500 ? 'server_error' : 'invalid_request_error',
                                   param: null, code: code}});
}

// nginx's own errors, as the router answers them: status -> [the status answered, message,
// code] (494: nginx's own code for a header too large, answered 400; 405: a TRACE, refused by
// nginx before any location; 412: nginx's not_modified filter, on an answer of the script's
// own; 501: a Transfer-Encoding other than chunked; 505: an HTTP version past 1.1). The table
// is made only when an error page asks (each request runs the script's top level again: njs
// 0.7.9 clones the VM and runs its global code per request, ngx_http_js_init_vm
// njs_vm_clone/njs_vm_start, so a table there would be built for every request).
function nginxError(status) {
    var e = {
        400: [400, 'the request is not valid HTTP', 'invalid_request'],
        404: [404, 'no such route on this endpoint (the router carries the OpenAI routes: ' +
                  '/v1/models, /v1/chat/completions, ...)', 'route_not_found'],
        413: [413, 'request body over router.max_body_mib', 'request_too_large'],
        405: [405, 'the method is not allowed on this endpoint (GET for /v1/models, POST for ' +
                  'the routes)', 'method_not_allowed'],
        412: [412, 'a precondition of the request (If-Match, If-Unmodified-Since) failed: the ' +
                  "router's answers carry no ETag", 'precondition_failed'],
        414: [414, 'the request URI is too long', 'invalid_request'],
        494: [400, 'a request header is too large', 'invalid_request'],
        500: [500, 'internal error of the router', 'internal_error'],
        501: [501, 'the request\'s Transfer-Encoding is not one the router reads (chunked)',
                  'not_implemented'],
        505: [505, 'the HTTP version is not supported (HTTP/1.0 and HTTP/1.1)',
                  'http_version_not_supported'],
    }[status] || [500, 'internal error of the router', 'internal_error'];
    return errorText(e[0], status === 413 ? e[1] + ' (' + CONFIG.max_body_mib + ' MiB)' : e[1],
                     e[2]);
}

// The text of an error page (js_set $router_error_STATUS, gpud.core.routerconf ERROR_PAGES: one
// handler for all, as each handler is a member of the script's default export, made again for
// every request): STATUS is the last segment of the error page's URI (ERROR_PREFIX + STATUS,
// where each variable is asked).
function errorPage(r) {
    return nginxError(Number(r.uri.slice(r.uri.lastIndexOf('/') + 1)));
}

// With router.api_keys_file: the request's key (its name and models), or null once answered
// 401. Without: {models: ['*']}. Tokens are compared by their SHA-256 (the table holds
// nothing else).
function keyOf(r) {
    if (CONFIG.keys === null) {
        return {name: null, models: ['*']};
    }
    var key = lookUp(r);
    if (key === undefined) {
        unauthorized(r);
        return null;
    }
    return key;
}

// The name of the request's key (js_set $router_key_name): "" when the request gives none
// or one not known (keys off: ""). One SHA-256 a request: nginx keeps a js_set variable's
// value for the rest of the request once asked (ngx_http_js_variable_set leaves it cacheable,
// njs 0.7.9 nginx/ngx_http_js_module.c; ngx_http_get_flushed_variable, nginx's
// src/http/ngx_http_variables.c), internal redirects included (ngx_http_internal_redirect
// clears the modules' contexts, not r->variables). A routed location's `if` asks it in the
// rewrite phase, before the body is read (gpud.core.router.http_lines).
function keyName(r) {
    if (CONFIG.keys === null) {
        return '';
    }
    var token = tokenOf(r);
    var digest = token ? crypto.createHash('sha256').update(token).digest('hex') : '';
    return token && has(CONFIG.keys, digest) ? CONFIG.keys[digest].name : '';
}

// Anthropic's routes, where its SDK sends the key as `x-api-key: KEY` (its default header).
function anthropic(r) {
    return r.uri === '/v1/messages' || r.uri === '/v1/messages/count_tokens';
}

// The token the request gives: `Authorization: Bearer TOKEN`; on Anthropic's routes, else
// `x-api-key: TOKEN` (Authorization first when both are sent). null: none.
function tokenOf(r) {
    var m = (r.headersIn['Authorization'] || '').match(/^Bearer\s+(\S+)\s*$/i);
    if (m) {
        return m[1];
    }
    if (anthropic(r)) {
        m = (r.headersIn['X-Api-Key'] || '').match(/^\s*(\S+)\s*$/);
        return m ? m[1] : null;
    }
    return null;
}

function noKeyMessage(r) {
    // Whether the request sent a key at all (a 401's message: incorrect, or none given).
    function gaveKey(r) {
        return Boolean(r.headersIn['Authorization'] ||
                       (anthropic(r) && r.headersIn['X-Api-Key']));
    }
    return gaveKey(r) ? 'Incorrect API key provided' :
        'No API key provided (Authorization: Bearer KEY' +
        (anthropic(r) ? ', or x-api-key: KEY' : '') + ')';
}

// The key of the request's token, undefined when none is given or known.
function lookUp(r) {
    var name = r.variables.router_key_name;
    return name ? CONFIG.keys[CONFIG.key_digests[name]] : undefined;
}

function unauthorized(r) {
    r.headersOut['WWW-Authenticate'] = 'Bearer';
    fail(r, 401, noKeyMessage(r), 'invalid_api_key');
}

// unauthorized()'s document, for the 401 of the key's check before the body (an error page).
function unauthorizedText(r) {
    return errorText(401, noKeyMessage(r), 'invalid_api_key');
}

// Who asks (gpud bounds each one, docs/router.md "Who is asking"): the key's name, else the
// client's address, every loopback address one: addr:loopback (the front's map,
// gpud.core.nginxblocks REQUESTER_ADDR; docs/security.md). KEY: the request's, else looked up (a
// fronted port's ensure: js_set $router_requester_of).
function requesterOf(r, key) {
    if (key === undefined) {
        key = CONFIG.keys === null ? undefined : lookUp(r);
    }
    return key && key.name ? key.name : 'addr:' + r.variables.gpud_requester_addr;
}

// Who asks through the router, and the name its usage is counted under (the access log's
// key): {requester, usage}, or {error} for a forwarded requester refused (docs/peers.md, "Who is
// asking, across hosts"). A key the keys file marks `peer = true` is another gpud host's, which
// forwards its own client's requester in X-Gpud-Requester: that one is taken, as PEER/NAME (a
// key's name has no "/", so it is never a local key's). From any other key, or none, the header
// is ignored: a client cannot name itself someone else. A duplicate header reaches here joined
// by commas (njs r.headersIn), which the pattern refuses.
function whoOf(r, key) {
    var own = {requester: requesterOf(r, key), usage: key.name || ''};
    if (!key.peer) {
        return own;
    }
    var sent = r.headersIn['X-Gpud-Requester'];
    if (sent === undefined || sent === '') {
        return own;
    }
    if (!new RegExp('^(?:' + CONFIG.forwarded_requester + ')$').test(sent)) {
        return {error: 'X-Gpud-Requester ' + JSON.stringify(sent.slice(0, 80)) + ' from peer key ' +
                key.name + ' is not a requester (a letter or digit, then letters, digits and ' +
                '. _ @ : -; at most 64)'};
    }
    var name = key.name + '/' + sent;
    return {requester: name, usage: name};
}

// "1" when the request may pass a fronted port's key check (js_set $router_key_ok): keys
// off, or a key that may use one of the names of the port's serve ($gpud_serve, set by its
// server).
function keyOk(r) {
    if (CONFIG.keys === null) {
        return '1';
    }
    var key = lookUp(r), serve = r.variables.gpud_serve;
    return key !== undefined && Object.keys(CONFIG.models).some(function (name) {
        return CONFIG.models[name].serve === serve && allows(key, name);
    }) ? '1' : '';
}

function allows(key, model) {
    return key.models.indexOf('*') >= 0 || key.models.indexOf(model) >= 0;
}

// The request's body read, on the router (route) and on a fronted port (fronted): a form's
// `model` (multipart/form-data), else the JSON object's, walked from SCAN_FROM bytes on
// (topLevel), parsed below. {model, stream, form (true, else absent), doc (parsed), top
// (walked)}; null once answered (a 400).
function readBody(r, body) {
    var type = (r.headersIn['Content-Type'] || '').toLowerCase();
    if (type.indexOf('multipart/form-data') === 0) {
        return {model: formModel(body, r.headersIn['Content-Type'] || ''), stream: false,
                form: true};
    }
    if (body.length >= SCAN_FROM) {
        var top = topLevel(body);
        if (top.error) {
            fail(r, top.error[0], top.error[1], top.error[2]);
            return null;
        }
        return {model: top.model, stream: top.stream, top: top};
    }
    var doc;
    try {
        doc = JSON.parse(body.toString());
    } catch (e) {
        fail(r, 400, 'the request body is not valid JSON: ' + e.message, 'invalid_json');
        return null;
    }
    if (doc === null || typeof doc !== 'object' || Array.isArray(doc)) {
        fail(r, 400, 'the request body is not a JSON object', 'invalid_json');
        return null;
    }
    return {model: doc.model, stream: doc.stream === true, doc: doc};
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
    var read = readBody(r, body);
    if (read === null) {
        return;
    }
    var model = read.model, stream = read.stream;
    if (model === undefined || model === null) {
        fail(r, 400, 'the request names no "model"', 'missing_model', 'model');
        return;
    }
    if (typeof model !== 'string') {
        fail(r, 400, '"model" must be a string', 'invalid_model', 'model');
        return;
    }
    // a model on several hosts: gpud says which takes it now (choose), the rest as below
    if (has(CONFIG.shared, model) && allows(key, model) && !hopped(r)) {
        choose(r, model).then(function (host) {
            if (!toChosen(r, host, model, key, stream)) {
                routeHere(r, key, body, read);
            }
        });
        return;
    }
    routeHere(r, key, body, read);
}

// The rest of route() once the request stays on this host: to a peer that has its model, or
// to its serve here (a top-level function, not a closure made on each request).
function routeHere(r, key, body, read) {
    var model = read.model, stream = read.stream;
    var entry = has(CONFIG.models, model) ? CONFIG.models[model] : undefined;
    if (entry === undefined && allows(key, model) && forward(r, model, key, stream)) {
        return;
    }
    // a model the key may not use answers as one that does not exist (as GET /v1/models/ID)
    if (entry === undefined || !allows(key, model)) {
        notFound(r, model, key);
        return;
    }
    // a peer key's forwarded requester (whoOf); any other key, or none, is its own
    var who = key.peer ? whoOf(r, key) : null;
    if (who !== null && who.error) {
        fail(r, 400, who.error, 'invalid_requester', 'X-Gpud-Requester');
        return;
    }
    r.variables.router_model = model;
    r.variables.router_serve = entry.serve;
    // the access log's key: usage is counted under it (a peer's forwarded requester: PEER/NAME)
    r.variables.router_key = who !== null ? who.usage : key.name || '';
    r.variables.router_requester = who !== null ? who.requester :
        key.name || requesterOf(r, key);
    if (stream && entry.stream_usage) {
        askUsage(r, body, read.doc, read.top, entry, stream);
    }
    if (entry.priority && !read.form && PRIORITY_ROUTES.indexOf(r.uri) >= 0 &&
        !keyPriority(r, body, read.doc, read.top, key)) {
        return;
    }
    if (entry.ensure && CONFIG.loading_feedback_s > 0 && stream) {
        // through the key's limits first (@router_loading), then loading(): loadingStream
        r.internalRedirect('@router_loading');
        return;
    }
    r.internalRedirect(entry.location);
}

// The 404 of a model that does not exist, or that KEY may not use (route; fronted, where the
// port's serve has no such name), in OpenAI's shape (code model_not_found), with the names
// close to it the key may use.
function notFound(r, model, key) {
    var close = closeNames(model, key);
    fail(r, 404, 'The model ' + JSON.stringify(model) + ' does not exist on this endpoint' +
         (close.length ? '; did you mean ' + close.map(function (n) {
             return JSON.stringify(n); }).join(', ') + '?' : '') +
         ' (GET /v1/models lists them)', 'model_not_found', 'model');
}

// Whether the request came from another host's router (its hop header, docs/peers.md): it is
// never forwarded again, so that two hosts listing each other's models never loop.
function hopped(r) {
    return r.headersIn['X-Gpud-Via'] !== undefined;
}

// A model that lives only on peers (CONFIG.peer_models, in the order tried): the request goes
// to the first whose circuit is closed, to its named location (gpud.core.router
// _peer_location: the peer's router, this host's key there, the requester and the hop header
// set there). Every peer's circuit open: 503 at once, Retry-After, the hosts and why. False:
// no peer has it (or the request came from a peer): the caller answers as for any unknown
// model.
function forward(r, model, key, stream) {
    if (!has(CONFIG.peer_models, model) || hopped(r)) {
        return false;
    }
    var names = CONFIG.peer_models[model], i, peer;
    for (i = 0; i < names.length; i++) {
        peer = CONFIG.peers[names[i]];
        if (peer.open === null) {
            toPeer(r, names[i], model, key, stream);
            return true;
        }
    }
    r.variables.router_model = model;
    r.variables.router_peer = names[0];
    r.variables.router_key = key.name || '';
    r.headersOut['Retry-After'] = String(PEER_RETRY_AFTER_S);
    fail(r, 503, 'model ' + JSON.stringify(model) + ' is served by ' + names.map(function (n) {
        return 'host ' + n + ' (unreachable: ' + (CONFIG.peers[n].open.reason || 'failure') +
            ')';
    }).join(', ') + '; retry after ' + PEER_RETRY_AFTER_S + ' s', 'peer_unreachable');
    return true;
}

// The request to peer NAME's named location, this router's requester and the access log's
// fields set.
function toPeer(r, name, model, key, stream) {
    r.variables.router_model = model;
    r.variables.router_peer = name;
    r.variables.router_key = key.name || '';
    r.variables.router_requester = requesterOf(r, key);
    r.internalRedirect(CONFIG.peers[name].location + (stream ? '_stream' : ''));
}

// Which host takes a request for a model on several hosts (CONFIG.shared): gpud's answer
// (GET /v1/route: gpud.core.peers.choose_host over this host's state, queue and expected
// wait and what each peer last said of the model, its circuit closed), one subrequest: ''
// this host, a peer's name, null none; undefined when gpud does not answer.
function choose(r, model) {
    return r.subrequest(ROUTE_LOCATION, {
        method: 'GET', args: 'model=' + encodeURIComponent(model)}).then(function (reply) {
        if (reply.status === 200) {
            try {
                var doc = JSON.parse(reply.responseText);
                return doc.found ? (doc.peer === null ? '' : String(doc.peer)) : null;
            } catch (e) {
                // gpud's answer unreadable: as gpud not answering
            }
        }
        return undefined;
    }, function () { return undefined; });
}

// Follows gpud's choice HOST (choose): true when the request went to a peer. A peer the
// script knows as open (its circuit opened since gpud answered) is never sent to. False:
// the request goes on here, or, when no serve here has it, to forward() (the first peer whose
// circuit is closed; all open: 503 at once), as without a choice.
function toChosen(r, host, model, key, stream) {
    if (typeof host === 'string' && host !== '' && has(CONFIG.peers, host) &&
            CONFIG.peers[host].open === null) {
        toPeer(r, host, model, key, stream);
        return true;
    }
    return false;
}

// A forwarded request the peer did not take (nginx's 502/504 of the peer's location: no
// connection, no answer in time, or a proxy between the hosts answering for it): 502 in
// OpenAI's shape, naming the host. Nothing had gone to the client yet (an error page is
// never taken once the answer began).
function peerDown(r) {
    var name = r.variables.router_peer || '?';
    r.headersOut['Retry-After'] = String(PEER_RETRY_AFTER_S);
    fail(r, 502, 'model ' + JSON.stringify(r.variables.router_model || '') + ': host ' + name +
         ' did not answer (' + (r.variables.upstream_status === '504' ? 'timed out' :
         'no connection, or a proxy between the hosts failed') + ')', 'peer_unreachable');
}

// A peer's answer as it passes (a body filter of its location, each buffer on at once): the
// usage meter as a serve's, and, for a stream, whether it ended as streams end (OpenAI's
// `data: [DONE]`; Anthropic's message_stop; the Responses API's last event). A stream that
// stops short (the peer gone mid-stream) ends with an error event, not silence. The filter's
// VM is the request's own: the globals are this answer's.
var pTail = '', pSse = null;
function peerStreamed(r, data, flags) {
    if (pSse === null) {
        pSse = r.status === 200 && (r.headersOut['Content-Type'] || '')
            .indexOf('text/event-stream') === 0;
    }
    if (!pSse) {
        meter(r, data, flags);
        return;
    }
    if (data.length > 0) {
        pTail = (pTail + data.toString()).slice(-256);
        meterScan(r, data, false);
    }
    if (!flags.last) {
        r.sendBuffer(data, flags);
        return;
    }
    meterScan(r, '', true);
    if (/data: \[DONE\]\s*$|message_stop|event: error|response\.(completed|failed|incomplete)/
            .test(pTail)) {
        r.sendBuffer(data, flags);
        return;
    }
    r.sendBuffer(data, {last: false});
    r.sendBuffer(errorEvent(r, 502, {error: {
        message: 'model ' + JSON.stringify(r.variables.router_model || '') + ': host ' +
                 (r.variables.router_peer || '?') + ' ended the stream before its end',
        type: 'server_error', param: null, code: 'peer_unreachable'}}), flags);
}

// gpud's code of an ensure refused because its requester (or everyone) has as many
// requests waiting as gpud keeps (gpud.server.api._too_many_waiting): the router's 429.
var TOO_MANY_WAITING = 'too-many-requests';

// The one 429 of the router, a key's limits (limited) and gpud's bound on waiting requests
// (refusal) alike: OpenAI's own shape for a rate limit (type "requests", code
// "rate_limit_exceeded": the body api.openai.com answers, which openai-python raises as
// RateLimitError by its status), with which limit and its figure under error.gpud, and the
// seconds for Retry-After. GPUD: {limit, value, ...}; the retry is added to it.
function rateLimited(message, retry, gpud) {
    gpud.retry_after_s = retry;
    return {status: 429, retry: String(retry), doc: {error: {
        message: message + '; retry after ' + retry + ' s', type: 'requests', param: null,
        code: 'rate_limit_exceeded', gpud: gpud}}};
}

// The 503 (429 when the requester waits too much already) of a refusal, with the seconds
// for Retry-After (gpud's RETRY, else the router's): gpud's reason (its X-Gpud-Reason,
// OpenAI's error shape) under error.gpud.
function refusal(r, reason, retry) {
    var message = 'refused by gpud', details = null;
    try {
        var doc = JSON.parse(reason);
        message = doc.error.message;
        details = doc.error;
    } catch (e) {
        // no reason given
    }
    var model = JSON.stringify(r.variables.router_model);
    if (details !== null && details.code === TOO_MANY_WAITING) {
        var why = details.details || {};
        return rateLimited('model ' + model + ': ' + message,
                           Number(retry) || why.retry_after_s || CONFIG.retry_after_s,
                           {limit: why.limit, value: why.value, serve: why.serve,
                            requester: why.requester});
    }
    return {status: 503, retry: retry || String(CONFIG.retry_after_s), doc: {error: {
        message: 'model ' + model + ' (serve ' + r.variables.router_serve +
                 ') cannot be brought up: ' + message,
        type: 'server_error', param: null, code: 'model_unavailable', gpud: details}}};
}

// The SSE bytes that end a stream with an error (DOC: OpenAI's error document, or already
// Anthropic's; STATUS: the answer's). OpenAI's clients read an event whose data is the error
// document, then [DONE], as vLLM ends a stream that failed. Anthropic's (route /v1/messages)
// read only named events: `event: error` with {"type": "error", "error": {type, message}}
// (anthropic-sdk-python src/anthropic/_streaming.py Stream.__stream__: an event named
// "error" is raised as the status error of its data; an unnamed one is skipped), and no
// [DONE] (a stream of Anthropic's ends with message_stop, or this error).
function errorEvent(r, status, doc) {
    if (r.uri !== '/v1/messages') {
        return 'data: ' + JSON.stringify(doc) + '\n\ndata: [DONE]\n\n';
    }
    var err = doc && doc.error ? doc.error : {};
    if (!(doc && doc.type === 'error' && typeof err.type === 'string')) {
        // Anthropic's error types (the `type` of its error object, anthropic-sdk-python
        // src/anthropic/types/*_error_object.py; docs.anthropic.com/en/api/errors) by status
        var types = {400: 'invalid_request_error', 401: 'authentication_error',
                     402: 'billing_error', 403: 'permission_error', 404: 'not_found_error',
                     429: 'rate_limit_error', 503: 'overloaded_error', 504: 'timeout_error',
                     529: 'overloaded_error'};
        doc = {type: 'error', error: {
            type: has(types, status) ? types[status] :
                status >= 500 ? 'api_error' : 'invalid_request_error',
            message: typeof err.message === 'string' ? err.message : JSON.stringify(doc)}};
    }
    return 'event: error\ndata: ' + JSON.stringify(doc) + '\n\n';
}

// Sends TEXT to the client of the stream R (its header first, once): false when the client is
// gone. njs 0.7.9's r.send and r.sendHeader throw when nginx cannot write (the connection
// closed: ngx_http_output_filter's NGX_ERROR, nginx/ngx_http_js_module.c
// ngx_http_js_ext_send); the request is then ended with 499 (r.return with no text: only
// the status nginx finalizes it with, ngx_http_js_ext_return), once nothing of the script
// is pending (ngx_http_js_handle_vm_event posts the request when the VM has no events left;
// ngx_http_js_content_write_event_handler then finalizes it, and nginx terminates a request
// whose connection failed, closing its subrequests' upstreams: the ensure).
var headerSent = false;  // the stream's header (a script's globals are its request's own)
function send(r, text) {
    try {
        if (!headerSent) {
            headerSent = true;
            r.variables.router_sse = 'stream';
            r.status = 200;
            r.headersOut['Content-Type'] = 'text/event-stream';
            r.headersOut['Cache-Control'] = 'no-cache';
            r.sendHeader();
        }
        r.send(text);
        return true;
    } catch (e) {
        r.return(499);
        return false;
    }
}

// The ends of a stream that had loading feedback (r.finish: its last buffer; a closed
// connection makes it throw too).
function finish(r) {
    try {
        r.finish();
    } catch (e) {
        r.return(499);
    }
}

// How soon a waiting stream looks whether gpud has answered its ensure: every millisecond for
// its first POLL_FAST_MS (a serve that is up is answered in a millisecond or two), then
// twice as long each time, up to every POLL_MS.
var POLL_FAST_MS = 20, POLL_MS = 100;

// gpud's answer to a loading feedback's ensure (the header filter of its location, in the
// subrequest: its variables are its parent's): {status, reason, retry}.
function ensured(r) {
    r.variables.router_ensured = JSON.stringify({
        status: r.status, reason: r.headersOut['X-Gpud-Reason'] || '',
        retry: r.headersOut['Retry-After'] || ''});
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
// - the stream begun, gpud refused: an error event (errorEvent), then the stream's end.
// The ensure is a detached subrequest whose answer the script looks for ($router_ensured),
// never a promise: a promise of a subrequest keeps the script pending (njs_vm_pending) until
// it resolves, and while it is pending a client that hung up can end its request only by an
// uncaught exception (logged `js exception`; L8). A promise of a subrequest whose connection
// failed never resolves at all (ngx_http_js_subrequest_done returns before the callback when
// r->connection->error), so no comment is sent while the queue note's subrequest is out.
function loading(r, model, entry) {
    var began = Date.now(), every = CONFIG.loading_feedback_s * 1000;
    var due = Math.min(1000, every), wait = 1;
    r.subrequest(CONFIG.ensure_prefix + entry.serve + CONFIG.loading_suffix,
                 {method: 'POST', detached: true});
    function look() {
        var answer = r.variables.router_ensured;
        if (answer) {
            answered(JSON.parse(answer));
        } else if (Date.now() - began < due) {
            wait = Date.now() - began < POLL_FAST_MS ? 1 : Math.min(POLL_MS, wait * 2);
            setTimeout(look, wait);
        } else if (send(r, ': loading ' + model + '\n\n')) {
            due += every;
            queueNote(r, entry.serve).then(function (note) {
                if (!note || send(r, ': ' + note + '\n\n')) {
                    setTimeout(look, POLL_MS);
                }
            });
        }
        // else: the client is gone, and nothing is left pending
    }
    function answered(reply) {
        r.variables.router_ensure_s = ((Date.now() - began) / 1000).toFixed(3);
        var sent = headerSent;
        if (reply.status === 403) {
            var refused = refusal(r, reply.reason, reply.retry);
            if (!sent) {
                r.headersOut['Retry-After'] = refused.retry;
                r.headersOut['Content-Type'] = 'application/json';
                r.return(refused.status, JSON.stringify(refused.doc));
                return;
            }
            r.variables.router_sse = 'refused';
            if (send(r, errorEvent(r, refused.status, refused.doc))) {
                finish(r);
            }
        } else if (!sent) {
            r.internalRedirect(entry.location + '_direct');
        } else if (send(r, '<!--# include virtual="' + CONFIG.stream_prefix + entry.serve +
                        r.uri + '" -->')) {
            // The stream's last buffer on the next turn of the event loop, not now: an include
            // that fails at once (the serve's socket refusing: its 502 answered by
            // streamDown) ends before the script does, and nginx then holds a last buffer
            // sent behind it until a write event that never comes (the postponed output is
            // flushed by ngx_http_writer, which the script's request only gets when it ends
            // after its include; njs's ngx_http_js_content_write_event_handler flushes it
            // while the script is pending). The timer keeps the script pending until then.
            setTimeout(function () { finish(r); }, 0);
        }
    }
    setTimeout(look, wait);
}

// gpud's list at LOCATION (its FIELD: serves, peers) by name; {} when gpud's answer is
// unreadable or missing (every state unknown).
function byName(r, location, field) {
    return r.subrequest(location, {method: 'GET'}).then(function (reply) {
        var by = {};
        if (reply.status === 200) {
            try {
                JSON.parse(reply.responseText)[field].forEach(function (s) {
                    by[s.name] = s;
                });
            } catch (e) {
                // gpud's answer unreadable: every state unknown
            }
        }
        return by;
    }, function () { return {}; });
}

function states(r) {
    return byName(r, '/.gpud-router-serves', 'serves');
}

// A model of /v1/models as ME (the request's requester) sees it: who waits for its serve, in
// the order they go, each requester's count and place, but only ME's name: the others' are
// null (a key's name is its holder's business; `gpuctl models` shows them to the operator);
// and, while requests wait for memory, what they wait for and until when (gpud's `waiting`:
// requests, reason, in_s; gpud.core.queue.waiting_for), which names serves, no requester.
function entry(name, by, created, me) {
    var serve = CONFIG.models[name].serve;
    var s = has(by, serve) ? by[serve] : null;
    var ext = {host: CONFIG.host, serve: serve, state: s ? s.state : 'unknown'};
    if (CONFIG.shared && has(CONFIG.shared, name)) {
        // a model on several hosts is listed once, with its hosts ("": this one)
        ext.hosts = CONFIG.shared[name].map(function (h) { return h || CONFIG.host; });
    }
    if (s && s.queue) {
        ext.queue = s.queue.map(function (p) {
            return {requester: p.requester === me ? me : null, waiting: p.waiting,
                    position: p.position};
        });
        ext.expected_wait_s = s.expected_wait_s;
    }
    if (s && s.waiting) {
        ext.waiting = {requests: s.waiting.requests, reason: s.waiting.reason,
                       in_s: s.waiting.in_s};
    }
    return {id: name, object: 'model', created: created, owned_by: 'gpud', gpud: ext};
}

// A waiting stream's place in gpud's queue, for its loading comments: its requester's place
// in the fair order, how many wait for the serve, and the wait to expect from the measured
// bring-ups ('' when it is not queued, or gpud does not say).
function queueNote(r, serve) {
    return states(r).then(function (by) {
        var s = has(by, serve) ? by[serve] : null;
        var me = r.variables.router_requester, waiting = 0, mine = null;
        ((s && s.queue) || []).forEach(function (p) {
            waiting += p.waiting;
            if (p.requester === me) {
                mine = p;
            }
        });
        if (mine === null) {
            return '';
        }
        return 'queued: position ' + mine.position + ', ' + waiting + ' waiting for ' +
            serve + (typeof s.expected_wait_s === 'number' ? ', expected wait ' +
            Math.round(s.expected_wait_s) + ' s (measured bring-ups)' : '');
    });
}

// What this host's gpud last heard from each peer (GET /v1/peers: name -> its view), {} when
// there are no peers or gpud does not answer.
function peerViews(r) {
    if (Object.keys(CONFIG.peer_models).length === 0) {
        return Promise.resolve({});
    }
    return byName(r, PEERS_LOCATION, 'peers');
}

// A model served on peers only, as this host lists it: the host that takes its requests
// (gpud.host: the first whose circuit is closed), every host that has it, its state and queue
// as that host reported them ("unreachable" while every one's circuit is open), and the hop
// marker (gpud.via: a host reading this list never offers it again; gpud.core.peers).
function peerEntry(name, views, created) {
    var hosts = CONFIG.peer_models[name], host = null, i, ext, v, m;
    for (i = 0; i < hosts.length && host === null; i++) {
        if (CONFIG.peers[hosts[i]].open === null) {
            host = hosts[i];
        }
    }
    ext = {host: host === null ? hosts[0] : host, hosts: hosts, via: host === null ? hosts[0] :
           host, state: host === null ? 'unreachable' : 'unknown'};
    v = has(views, ext.host) ? views[ext.host] : null;
    if (v && host !== null) {
        ext.state = v.circuit === 'closed' ? 'unknown' : 'unreachable';
        m = (v.models || []).filter(function (x) { return x.id === name; })[0];
        if (m && v.circuit === 'closed') {
            ext.state = m.state;
            ext.expected_wait_s = m.expected_wait_s;
            ext.queued = m.queued;
        }
    }
    if (ext.state === 'unreachable') {
        v = CONFIG.peers[ext.host].open;
        ext.reason = v ? v.reason : null;
    }
    return {id: name, object: 'model', created: created, owned_by: 'gpud', gpud: ext};
}

// The peers' models listed to this request: none to a request that came from a peer (a host
// never offers on what it offers from its peers).
function peerNames(r, key) {
    return hopped(r) ? [] : Object.keys(CONFIG.peer_models).filter(function (name) {
        return allows(key, name);
    });
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
    // ME: who sees the queue (a peer's forwarded requester when it is one; else the key's)
    var me = whoOf(r, key).requester || requesterOf(r, key);
    states(r).then(function (by) {
        return peerViews(r).then(function (views) {
            var created = Math.floor(Date.now() / 1000);
            var data = Object.keys(CONFIG.models).sort().filter(function (name) {
                return allows(key, name);
            }).map(function (name) {
                return entry(name, by, created, me);
            }).concat(peerNames(r, key).sort().map(function (name) {
                return peerEntry(name, views, created);
            }));
            r.headersOut['Content-Type'] = 'application/json';
            r.return(200, JSON.stringify({object: 'list', data: data}));
        });
    });
}

function model(r) {
    var key = keyOf(r);
    if (key === null) {
        return;
    }
    if (r.method !== 'GET' && r.method !== 'HEAD') {
        r.headersOut['Allow'] = 'GET, HEAD';
        fail(r, 405, 'method ' + r.method + ' not allowed on /v1/models/ID (GET)',
             'method_not_allowed');
        return;
    }
    var name = r.uri.slice('/v1/models/'.length);
    if (!has(CONFIG.models, name) && peerNames(r, key).indexOf(name) >= 0) {
        peerViews(r).then(function (views) {
            r.headersOut['Content-Type'] = 'application/json';
            r.return(200, JSON.stringify(peerEntry(name, views, Math.floor(Date.now() / 1000))));
        });
        return;
    }
    if (!has(CONFIG.models, name) || !allows(key, name)) {
        var close = closeNames(name, key);
        fail(r, 404, 'The model ' + JSON.stringify(name) + ' does not exist on this endpoint' +
             (close.length ? '; did you mean ' + close.map(function (n) {
                 return JSON.stringify(n); }).join(', ') + '?' : ''), 'model_not_found');
        return;
    }
    states(r).then(function (by) {
        r.headersOut['Content-Type'] = 'application/json';
        r.return(200, JSON.stringify(entry(name, by, Math.floor(Date.now() / 1000),
                                           requesterOf(r, key))));
    });
}

// gpud refused to bring the serve up (its ensure answered 403): 503 with gpud's reason.
function refused(r) {
    var refused = refusal(r, r.variables.router_reason, r.variables.router_retry);
    r.headersOut['Retry-After'] = refused.retry;
    r.headersOut['Content-Type'] = 'application/json';
    r.return(refused.status, JSON.stringify(refused.doc));
}

// The serve did not answer (stopped, starting, restarting; gpud down and the serve not up).
function down(r) {
    r.headersOut['Retry-After'] = String(CONFIG.retry_after_s);
    fail(r, 503, 'model ' + JSON.stringify(r.variables.router_model || '') + ': serve ' +
         (r.variables.router_serve || '?') + ' is not running', 'model_not_running');
}

// Usage (docs/router.md, "Who is asking"; gpud.core.usage): the serve's own `usage`, read as
// its answer passes (a body filter: each buffer passed on at once, untouched), for the access
// log: the top-level `usage` object of the answer, by the route's own names (input_tokens and
// output_tokens on /v1/responses and /v1/messages, else prompt_tokens and completion_tokens),
// never a count anywhere else in it (a tool's schema the answer echoes is the client's text).
// A stream (text/event-stream): each event that carries usage parsed whole (its data), its
// `usage`, or that of the response it carries (/v1/responses: `response.usage`; /v1/messages:
// message_start's `message.usage`, message_delta's `usage`), the last one of each name
// kept. Inside a JSON string a quote is escaped, so `"usage"` with both quotes bare is a key
// (or a string value "usage"): an event without it is not parsed, and most buffers (a
// stream's chunks) end at an event's end and carry none: one native search each. A single
// answer (JSON): held as it passes and parsed at its end when it carries a bare "usage"; one
// past SINGLE_MAX (embeddings of many inputs) is walked instead by its brackets as it passes
// (strings skipped whole), the value of its top-level "usage" key kept and parsed. An answer
// without usage leaves them "" (counted, never invented).
var USAGE_HELD_MAX = 16777216, SINGLE_MAX = 262144;
var mNames = null, mNested = null, mStream = false, mHeld = '', mSkip = false;
var mParts = null, mSize = 0, mWalking = false;
// the walk of a single answer: depth, inside a string, an escape cut by a buffer's end, the
// last string ended at the current depth (a key when a bracket follows), the keys of the
// open objects, and the usage object's text while it passes
var jDepth = 0, jInStr = false, jEsc = false, jStr = null, jLast = null, jKeys = null;
var jCap = null, jCapDepth = 0, J_OUT = null, J_IN = null;

// The answer's route and kind, from its first buffer: a single answer is one JSON document
// (vLLM's begin with `{`), a stream's events begin with `data:` or `event:`.
function meterBegin(r, data) {
    var route = r.uri;
    mNested = route === '/v1/responses' ? 'response' : route === '/v1/messages' ? 'message' :
        null;
    mNames = mNested !== null ? ['input_tokens', 'output_tokens'] :
        ['prompt_tokens', 'completion_tokens'];
    mStream = data[0] !== 0x7b && data[0] !== 0x5b;
}

function meterTake(r, usage) {
    if (usage === null || typeof usage !== 'object' || Array.isArray(usage)) {
        return;
    }
    for (var i = 0; i < 2; i++) {
        var v = usage[mNames[i]];
        if (typeof v === 'number' && Number.isInteger(v) && v >= 0 && v < 1e12) {
            r.variables[i ? 'router_completion_tokens' : 'router_prompt_tokens'] = String(v);
        }
    }
}

// One event of a stream (its lines): its data parsed when it carries usage.
function meterEvent(r, event) {
    if (event.indexOf('"usage"') < 0) {
        return;
    }
    var data = event.split('\n').filter(function (line) {
        return line.indexOf('data:') === 0;
    }).map(function (line) {
        return line.slice(line[5] === ' ' ? 6 : 5);
    }).join('\n');
    var doc;
    try {
        doc = JSON.parse(data);
    } catch (e) {
        return;
    }
    if (doc === null || typeof doc !== 'object') {
        return;
    }
    meterTake(r, doc.usage);
    if (mNested !== null && doc[mNested] !== null && typeof doc[mNested] === 'object') {
        meterTake(r, doc[mNested].usage);
    }
}

function meterEvents(r, data) {
    var n = data.length;
    if (mHeld === '' && !mSkip && data[n - 1] === 0x0a && data[n - 2] === 0x0a &&
        data.indexOf('"usage"') < 0) {
        return;
    }
    var text = mHeld + data.toString().replace(/\r\n/g, '\n');
    var cut = text.lastIndexOf('\n\n');
    if (cut < 0) {
        // an event longer than the buffers so far: held (bounded: past it, not metered)
        mHeld = mSkip || text.length > USAGE_HELD_MAX ? '' : text;
        mSkip = mSkip || text.length > USAGE_HELD_MAX;
        return;
    }
    var events = text.slice(0, cut).split('\n\n');
    if (mSkip) {
        events.shift();
        mSkip = false;
    }
    events.forEach(function (event) {
        meterEvent(r, event);
    });
    mHeld = text.slice(cut + 2);
}

// A single answer (JSON), held to its end (LAST), or walked once past SINGLE_MAX. Most are
// one buffer: parsed only when it carries a bare "usage" (one native search).
function meterSingle(r, data, last) {
    if (mWalking) {
        meterWalk(r, data.toString());
        return;
    }
    if (mParts === null && last) {
        if (data.indexOf('"usage"') >= 0) {
            meterParse(r, data);
        }
        return;
    }
    mParts = mParts || [];
    mParts.push(data);
    mSize += data.length;
    if (mSize > SINGLE_MAX) {
        mWalking = true;
        meterWalk(r, Buffer.concat(mParts).toString());
        mParts = [];
        return;
    }
    if (last) {
        var whole = mParts.length === 1 ? mParts[0] : Buffer.concat(mParts);
        if (whole.indexOf('"usage"') >= 0) {
            meterParse(r, whole);
        }
    }
}

// A single answer (BUF, whole) that carries a bare "usage": the usage of its top level. An
// answer ends with it and a few members after (vLLM's chat: usage, prompt_logprobs,
// prompt_token_ids, kv_transfer_params), so its last "usage" is tried first, as a member of
// the answer's own object: '{' and the text from it on make one JSON object only when the key
// is one (a key deeper in, an echoed schema's or a client's object after the usage, leaves
// that text closing more than one object) and its quote is no escaped one (a key that ends in
// \"usage). Its value then is what parsing the whole answer gives (the last of a key given
// twice, as JSON.parse takes), without the rest of the answer made into objects and strings.
// Else the whole answer is parsed.
function meterParse(r, buf) {
    var at = buf.lastIndexOf('"usage"'), from = at, doc;
    while (from > 0 && buf[from - 1] === 0x5c) {
        from--;
    }
    if (at > 0 && (at - from) % 2 === 0) {
        try {
            doc = JSON.parse('{' + buf.slice(at).toString());
        } catch (e) {
            doc = null;
        }
        if (doc !== null) {
            meterTake(r, doc.usage);
            return;
        }
    }
    try {
        doc = JSON.parse(buf.toString());
    } catch (e) {
        return;
    }
    if (doc !== null && typeof doc === 'object') {
        meterTake(r, doc.usage);
    }
}

function meterWalk(r, text) {
    if (J_OUT === null) {
        J_OUT = /["{}\[\]]/g;
        J_IN = /[\\"]/g;
        jKeys = [];
    }
    var n = text.length, i = 0, m, c, from = jCap !== null ? 0 : -1;
    if (jEsc) {
        i = 1;
        jEsc = false;
    }
    while (i < n) {
        if (jInStr) {
            J_IN.lastIndex = i;
            m = J_IN.exec(text);
            var end = m === null ? n : m.index;
            if (jStr !== null) {
                jStr = jStr.length + end - i > 16 ? null : jStr + text.slice(i, end);
            }
            if (m === null) {
                break;
            }
            if (m[0] === '\\') {
                jStr = null;
                jEsc = m.index + 1 >= n;
                i = m.index + 2;
                continue;
            }
            jInStr = false;
            jLast = jStr;
            i = m.index + 1;
            continue;
        }
        J_OUT.lastIndex = i;
        m = J_OUT.exec(text);
        if (m === null) {
            break;
        }
        c = m[0];
        i = m.index + 1;
        if (c === '"') {
            jInStr = true;
            jStr = jDepth <= 2 ? '' : null;
            jLast = null;
            continue;
        }
        if (c === '{' || c === '[') {
            // the key naming this value: the string just before it at this depth
            var key = c === '{' ? jLast : null;
            jKeys[jDepth] = key;
            if (jCap === null && key === 'usage' &&
                (jDepth === 1 || (jDepth === 2 && mNested !== null && jKeys[1] === mNested))) {
                jCap = '';
                jCapDepth = jDepth;
                from = m.index;
            }
            jDepth++;
        } else if (jDepth > 0) {
            jDepth--;
            if (jCap !== null && jDepth === jCapDepth) {
                var got;
                try {
                    got = JSON.parse(jCap + text.slice(from, i));
                } catch (e) {
                    got = null;
                }
                meterTake(r, got);
                jCap = null;
                from = -1;
            }
        }
        jLast = null;
    }
    if (jCap !== null) {
        jCap += text.slice(Math.max(0, from));
        if (jCap.length > 65536) {
            jCap = null;
        }
    }
}

function meterScan(r, data, last) {
    if (mNames === null) {
        if (data.length === 0) {
            return;
        }
        meterBegin(r, data);
    }
    if (mStream) {
        if (data.length === 0) {
            return;
        }
        meterEvents(r, data);
    } else {
        meterSingle(r, data, last);
    }
}

function meter(r, data, flags) {
    if (mAsked === null && data.length > 0) {
        // a single answer (JSON) is never one the router asked usage for: no variable read
        mAsked = data[0] !== 0x7b && r.variables.router_usage_asked === '1';
    }
    if (mAsked) {
        meterAsked(r, abortEvent(r, data), flags);
        return;
    }
    r.sendBuffer(abortEvent(r, data), flags);
    if (data.length > 0 || flags.last) {
        meterScan(r, data, flags.last);
    }
}

// A stream whose usage the router asked for (askUsage): passed on event by event (a buffer's
// last, unended event waits for its end), the chunk vLLM then adds (`"choices":[]` and the
// `usage`, after the last chunk with a finish_reason, before [DONE]) metered and taken out,
// so that the client is sent the stream it would have had. vLLM 0.32 also moves its
// `system_fingerprint` then: without include_usage it is the last member of each chunk with a
// finish_reason, with it only on the usage chunk (chat_completion/serving.py
// chat_completion_stream_generator, completion/serving.py completion_stream_generator: the
// chunks' model_dump_json(exclude_unset=True), and nothing else about them changes, `usage`
// unset on them as long as continuous_usage_stats is not asked). So a chunk with a
// finish_reason (a choice's last) is held until the usage chunk (vLLM sends it after every
// choice's last) and given its fingerprint back, taken byte for byte from the usage chunk;
// at [DONE] or the answer's end whatever is held goes as it is. Only those wait: with n > 1,
// the other choices' chunks go on as they come, ahead of the held last chunks (each choice's
// chunks in their order, its last one last). Bounded: past USAGE_HELD_MAX held, passed on
// as it is.
var mAsked = null, aPend = null, aHeld = null, aHeldSize = 0;
var FINGERPRINT = null;
function meterAsked(r, data, flags) {
    if (aHeld === null) {
        aHeld = [];
    }
    if (mNames === null && data.length > 0) {
        meterBegin(r, data);
    }
    if (mNames === null || !mStream) {
        // nothing yet, or not a stream (an error's document): as any answer
        r.sendBuffer(data, flags);
        if (data.length > 0 || flags.last) {
            meterScan(r, data, flags.last);
        }
        return;
    }
    var buf = aPend === null ? data : Buffer.concat([aPend, data]);
    var cut = buf.lastIndexOf('\n\n'), out = [], at, end;
    if (cut < 0) {
        aPend = buf;
    } else {
        aPend = cut + 2 < buf.length ? buf.slice(cut + 2) : null;
        for (at = 0; at < cut + 2; at = end) {
            end = buf.indexOf('\n\n', at) + 2;
            unasked(r, buf.slice(at, end), out);
        }
    }
    if (flags.last || aHeldSize + (aPend === null ? 0 : aPend.length) > USAGE_HELD_MAX) {
        out = out.concat(aHeld);
        if (aPend !== null) {
            out.push(aPend);
        }
        aHeld = [];
        aHeldSize = 0;
        aPend = null;
    }
    r.sendBuffer(out.length === 0 ? '' : out.length === 1 ? out[0] : Buffer.concat(out), flags);
}

// One whole event of an asked stream (EVENT, its blank line included) into OUT, or held.
function unasked(r, event, out) {
    if (event.indexOf('"usage"') >= 0) {
        var text = event.toString(), doc = eventData(text);
        if (doc !== null && Array.isArray(doc.choices) && doc.choices.length === 0) {
            meterTake(r, doc.usage);
            if (FINGERPRINT === null) {
                FINGERPRINT = /,"system_fingerprint":"(?:[^"\\]|\\.)*"/;
            }
            var fp = text.match(FINGERPRINT);
            aHeld.forEach(function (held) {
                var close = held.lastIndexOf('}');
                out.push(fp !== null && held.indexOf('"finish_reason":"') >= 0 && close > 0 ?
                         Buffer.concat([held.slice(0, close), Buffer.from(fp[0]),
                                        held.slice(close)]) : held);
            });
            aHeld = [];
            aHeldSize = 0;
            return;
        }
    }
    if (event.indexOf('data: [DONE]') === 0) {
        out.push.apply(out, aHeld);
        aHeld = [];
        aHeldSize = 0;
    } else if (event.indexOf('"finish_reason":"') >= 0) {
        aHeld.push(event);
        aHeldSize += event.length;
        return;
    }
    out.push(event);
}

// An event's data (its `data:` lines) parsed: null when it is not a JSON object.
function eventData(event) {
    var data = event.split('\n').filter(function (line) {
        return line.indexOf('data:') === 0;
    }).map(function (line) {
        return line.slice(line[5] === ' ' ? 6 : 5);
    }).join('\n');
    try {
        var doc = JSON.parse(data);
        return doc !== null && typeof doc === 'object' ? doc : null;
    } catch (e) {
        return null;
    }
}

// Past a count of the routed location (gpud.core.router conn_lines, before the body is read):
// the 429's document (js_set $router_counted_text, which @router_counted returns: nginx's
// `return` reads no body, a js_content handler would read it first). The key's
// max_concurrent, or the requester's large bodies open at once (router.
// large_bodies_per_requester): a request with a small body is counted by the first only; nginx
// does not say which zone refused one with a large body, so for a key with both, both are named.
function countedText(r) {
    var name = r.variables.router_key_name || '';
    var lim = has(CONFIG.limits, name) ? CONFIG.limits[name] : {};
    var bodies = CONFIG.large_bodies_per_requester;
    var large = bodies > 0 && r.variables.router_body_large === '1';
    var who = name ? 'key ' + name : 'client ' + r.variables.gpud_requester_addr;
    var which, value, message;
    if (large && !lim.max_concurrent) {
        which = 'large_bodies_per_requester';
        value = bodies;
        message = who + ' has ' + value + ' requests with a large body (10^6 bytes or more, ' +
                  'or chunked) open, router.large_bodies_per_requester';
    } else {
        which = 'max_concurrent';
        value = lim.max_concurrent;
        message = who + ' has ' + value + ' requests in flight, its max_concurrent' +
                  (large ? ', or ' + bodies + ' with a large body open, ' +
                   'router.large_bodies_per_requester' : '');
    }
    return JSON.stringify(rateLimited(message, 1, {key: name, limit: which, value: value}).doc);
}

// A stream the serve ended before its end: vLLM's abort (its last chunk says finish_reason
// "abort", then [DONE]; vllm/v1/engine/core.py pause_scheduler, mode=abort), when gpud puts the
// serve to sleep, or pauses it (/pause?mode=abort) to stop it, past daemon.drain_timeout_s for
// a waiting request (router.evict_busy), for a preemption, or for an operator's sleep. The chunk that says so is followed by an error event
// (errorEvent's, before [DONE]) naming why, so that no client reads a stream that merely
// stops: openai-python's Stream raises an event whose data has "error" as its APIError. The
// serve's bytes pass as they came; the event is put in after the ending event's "\n\n" (in a
// later buffer when that event was cut; a mark or a blank line cut between two buffers is
// found too). On /v1/messages (Anthropic's stream) vLLM 0.32 says
// an abort as a message_delta whose stop_reason is null, then message_stop
// (vllm/entrypoints/anthropic/serving.py: _to_anthropic_stop_reason maps a finish_reason
// other than stop, tool_calls and length to None; the usage chunk's message_delta sets it
// explicitly, so exclude_unset keeps it): Anthropic's `event: error` is put in after that
// message_delta (anthropic-sdk-python src/anthropic/_streaming.py Stream.__stream__ raises
// an event named "error" as the status error of its data). On /v1/responses vLLM 0.32 ends
// an aborted stream as a whole one (response.completed, its status "cancelled" only for a
// Harmony model: openai/responses/serving.py), so the stream alone cannot tell: gpud notes
// when it ends what is in flight on a serve (CUT_DIR, one file per serve, written anew just
// before each abort: gpud.life.traffic.Traffic.mark_cut), and a stream whose note changed
// between its first bytes and its end (read at both: an order, never two clocks' readings
// compared, which a tie in the same millisecond or a clock set back would turn) gets an error
// event after its response.completed: `event: error`, its data
// the Responses API's error event (type, code, message, param) with OpenAI's error document
// under `error` (openai-python's Stream raises an event whose data has "error" as its
// APIError). The filter's VM is this answer's own: `aborting`, `abortTold`, `aNote` too.
var ABORTS = null, MESSAGES_ABORTS = null, RESPONSES_END = null;
var ABORT_CARRY = 32;
var aborting = false, abortTold = false, aCarry = '', aLooked = false, aNote = '';
// gpud's note of the last time it ended what was in flight on this answer's serve (its file
// in CUT_DIR, new at each cut), '' for none.
function cutNote(r) {
    var serve = r.variables.router_serve;
    if (!CUT_DIR || !serve) {
        return '';
    }
    try {
        return fs.readFileSync(CUT_DIR + '/' + serve, 'utf8');
    } catch (e) {
        return '';
    }
}
// Whether gpud ended what was in flight on this answer's serve since the answer's first bytes
// came (its note then, aNote, is not its note now).
function cutSince(r) {
    return cutNote(r) !== aNote;
}
// The last ABORT_CARRY bytes seen, CARRY's then DATA's (a buffer may be shorter than a mark).
function carried(carry, data) {
    return (carry + data.slice(Math.max(0, data.length - ABORT_CARRY)).toString())
        .slice(-ABORT_CARRY);
}
// Where the mark of a cut stream (its route's: ABORTS, MESSAGES_ABORTS, the latter the
// message_delta's own, as pydantic writes it: its delta's only member set first;
// RESPONSES_END, a stream's last event, a cut only as cutSince says) begins in DATA, 0 when
// it began in the last buffer (aCarry: that buffer's last bytes), -1 if none.
function abortAt(r, data) {
    if (ABORTS === null) {
        ABORTS = ['"finish_reason":"abort"', '"finish_reason": "abort"'];
        MESSAGES_ABORTS = ['"delta":{"stop_reason":null', '"delta": {"stop_reason": null'];
        // the event's own line, after the blank line that ends the one before: never in a JSON
        RESPONSES_END = ['\n\nevent: response.completed\n'];
    }
    var marks = r.uri === '/v1/messages' ? MESSAGES_ABORTS :
        r.uri === '/v1/responses' ? RESPONSES_END : ABORTS, i, at;
    for (i = 0; i < marks.length; i++) {
        at = data.indexOf(marks[i]);
        if (at >= 0) {
            return at;
        }
    }
    var seam = aCarry + data.slice(0, ABORT_CARRY).toString();
    for (i = 0; i < marks.length; i++) {
        if (seam.indexOf(marks[i]) >= 0) {
            return 0;
        }
    }
    return -1;
}
function abortEvent(r, data) {
    if (abortTold || data.length === 0) {
        return data;
    }
    if (!aLooked) {
        aLooked = true;
        if (data[0] === 0x7b) {  // a single answer (JSON), not a stream: nothing to tell
            abortTold = true;
            return data;
        }
        if (r.uri === '/v1/responses') {
            aNote = cutNote(r);
        }
    }
    var end;  // the offset just past the blank line that ends the event in DATA; -1 not in it
    if (aborting && aCarry.slice(-1) === '\n' && data.slice(0, 1).toString() === '\n') {
        end = 1;  // its blank line cut between the last buffer and this one
    } else {
        var at = 0;
        if (!aborting) {
            at = abortAt(r, data);
            if (at < 0) {
                aCarry = carried(aCarry, data);
                return data;
            }
            if (r.uri === '/v1/responses') {
                if (!cutSince(r)) {
                    abortTold = true;  // a whole response
                    return data;
                }
                if (data.indexOf(RESPONSES_END[0]) === at) {
                    at += 2;  // the blank line that ends the event before it
                }
            }
            aborting = true;
        }
        end = data.indexOf('\n\n', at);
        end = end < 0 ? -1 : end + 2;
    }
    if (end < 0) {
        aCarry = carried(aCarry, data);
        return data;
    }
    abortTold = true;
    var serve = r.variables.router_serve || 'its serve';
    var error = {
        message: 'serve ' + serve + ' ended this request before its end: gpud put it to ' +
                 'sleep or stopped it past its drain bound (daemon.drain_timeout_s) to give ' +
                 'its GPU memory to another request, or for a preemption or an operator\'s ' +
                 'sleep; retry',
        type: 'server_error', param: null, code: 'request_aborted'};
    var ev;
    if (r.uri === '/v1/responses') {
        ev = 'event: error\ndata: ' + JSON.stringify({
            type: 'error', code: error.code, message: error.message, param: null,
            error: error}) + '\n\n';
    } else {
        ev = errorEvent(r, 503, {error: error});
        if (r.uri !== '/v1/messages') {
            ev = ev.slice(0, ev.indexOf('data: [DONE]'));
        }
    }
    if (typeof data === 'string') {
        return data.slice(0, end) + ev + data.slice(end);
    }
    return Buffer.concat([data.slice(0, end), Buffer.from(ev), data.slice(end)]);
}

// The serve's answer to a stream that had loading feedback (a body filter of the include):
// as it comes when the serve took the request; an error answer (vLLM's 4xx: OpenAI's error
// shape, one JSON document) once whole, as an error event and [DONE], as vLLM ends a
// stream that failed. The filter's VM is the subrequest's own: `held` is this answer's.
var held = '', told = false;
function streamed(r, data, flags) {
    if (r.status < 400 || told) {
        if (!told && r.variables.router_usage_asked === '1') {
            meterAsked(r, abortEvent(r, data), flags);
            return;
        }
        r.sendBuffer(told ? '' : abortEvent(r, data), flags);
        if (!told && data.length > 0) {
            meterScan(r, data, flags.last);
        }
        return;
    }
    held += data;
    // the answer's end: in a subrequest (the include) flags.last is never set (nginx marks
    // its last buffer last_in_chain, not last_buf): the length the serve said is in, or,
    // without one, an empty buffer after some data (an empty one may come first too)
    var length = r.variables.upstream_http_content_length;
    var end = flags.last || (length ? Buffer.byteLength(held) >= Number(length) :
                             data.length === 0 && held.length > 0);
    var doc;
    try {
        doc = JSON.parse(held);
    } catch (e) {
        // not (yet) one JSON document: wait for more, but not past its end (an error that
        // is not JSON, a proxy's HTML page, is passed on as the event's message)
        if (held.length < 65536 && !end) {
            return;
        }
        doc = {error: {message: held.slice(0, 1024), type: 'server_error', param: null,
                       code: r.status}};
    }
    held = '';
    told = true;
    r.sendBuffer(errorEvent(r, r.status, doc), flags);
}

// The serve did not answer a stream that had loading feedback: an error event.
function streamDown(r) {
    r.return(200, errorEvent(r, 503, {error: {
        message: 'model ' + JSON.stringify(r.variables.router_model || '') + ': serve ' +
                 (r.variables.router_serve || '?') + ' is not running',
        type: 'server_error', param: null, code: 'model_not_running'}}));
}

// A serve launched with --scheduling-policy priority orders its waiting requests by the body's
// `priority`, lower first (vllm 0.32: vllm/config/scheduler.py `policy`; the field in
// entrypoints/openai/*/protocol.py). The priority it reads is the key's (0 without one),
// whatever the client wrote, on every body, parsed or walked: the body is sent as three parts
// (gpud.core.router PRIORITY_MAP): the bytes before the top-level "priority" value, the
// value, the bytes after it; without one, `"priority":` and `,` around the value are put in
// after the opening brace. Every other byte goes as the client sent it (no re-serialization:
// an integer past 2^53, an escape, a key given twice, stay as they were). The value is the
// key's ($router_prio), or one step behind ($router_prio_over) when the requester already has
// its share of requests in flight on the serve (gpud.core.router FAIR_BODY). SPANS: the
// [start, end) of the body's top-level "priority" value, none or one.
// (A stream whose usage the router asks for has askUsage's member put in after the brace too.)
function prioritize(r, body, spans, key) {
    var base = key.priority !== undefined ? key.priority : 0;
    var brace = body.indexOf('{'), ask = Buffer.from(asking ? ASK_USAGE : '');
    if (spans.length === 0) {
        r.variables.router_body_head = Buffer.concat([body.slice(0, brace + 1), ask,
                                                      Buffer.from('"priority":')]);
        r.variables.router_body_tail = Buffer.concat([Buffer.from(','),
                                                      body.slice(brace + 1)]);
    } else {
        r.variables.router_body_head = Buffer.concat([body.slice(0, brace + 1), ask,
                                                      body.slice(brace + 1, spans[0][0])]);
        r.variables.router_body_tail = body.slice(spans[0][1]);
    }
    r.variables.router_prio = String(base);
    r.variables.router_prio_over = String(base + 1);
}

// Usage for a stream that did not ask (docs/router.md, "Who is asking"): vLLM sends a chat or
// completions stream's usage only when the body asks (vllm 0.32 entrypoints/serve/utils/
// api_utils.py should_include_usage: `stream_options.include_usage`, or the server's
// --enable-force-include-usage, which puts usage in every chunk as continuous_usage_stats does).
// So on a streamed request to a stream-usage serve (CONFIG.models[...].stream_usage) on those
// routes (STREAM_USAGE_ROUTES) whose body has no top-level "stream_options", the router
// puts ASK_USAGE in after the body's opening brace, every other byte as sent (the body is sent
// as head + priority + tail, gpud.core.router PRIORITY_MAP: without a priority, an empty
// one), and the meter takes the chunk the client did not ask for out of the stream
// (meterAsked). A body with its own "stream_options" goes as sent: its usage is there when it
// asked for it, else the request is counted unmetered.
var ASK_USAGE = '"stream_options":{"include_usage":true},';
var asking = false;
function askUsage(r, body, doc, top, entry, stream) {
    if (!stream || !entry.stream_usage || STREAM_USAGE_ROUTES.indexOf(r.uri) < 0 ||
        (doc !== undefined ? has(doc, 'stream_options') : top.streamOptions)) {
        return;
    }
    asking = true;
    r.variables.router_usage_asked = '1';
    if (!entry.priority) {
        var brace = body.indexOf('{');
        r.variables.router_body_head = Buffer.concat([body.slice(0, brace + 1),
                                                      Buffer.from(ASK_USAGE)]);
        r.variables.router_body_tail = body.slice(brace + 1);
    }
}

// The key's priority (or the share's) in the body of a request to a serve under priority
// scheduling, on the router (route) and on a fronted port (fronted): the body's top-level
// "priority" members (a parsed one, DOC, is walked only when it has one; TOP: the walk's
// answer when walked), given once at most; false once answered (a 400).
function keyPriority(r, body, doc, top, key) {
    if (top === undefined) {
        top = has(doc, 'priority') ? topLevel(body) : {priority: []};
        if (top.error) {
            fail(r, top.error[0], top.error[1], top.error[2]);
            return false;
        }
    }
    if (top.priority.length > 1) {
        fail(r, 400, 'the request body gives "priority" ' + top.priority.length +
             ' times: the router sets it (' + (key.name ? "the key's" : "the share's") +
             '), send it once or not at all', 'invalid_priority', 'priority');
        return false;
    }
    prioritize(r, body, top.priority, key);
    return true;
}

// A request on a serve's own fronted port, on a route whose body the router rewrites, or
// reads for its loading feedback (gpud.core.front body_routes: a location that reads the
// whole body in memory, after the key's check, its counts and rates): the same body as
// through the router, by the same functions (keyPriority, askUsage), then on to the serve
// (FRONT_SEND, which sends the body as rewritten: gpud.core.router FrontPolicy.send).
// The port's serve is $gpud_serve. A model that is none of its names, or one the key may not
// use, is answered as the router answers it (404 model_not_found; vLLM answers such a name
// 404 too, but only once up, an on-demand serve woken for it, and any of its names to any
// key the port lets in). A stream on a port that asks gpud's ensure itself (an on-demand
// serve's: $gpud_loading) goes on to the router's loading feedback (@router_loading,
// loadingStream), as through the router.
function fronted(r) {
    var body = r.requestBuffer, serve = r.variables.gpud_serve, entry = serveEntry(serve);
    var read, doc, top, stream;
    var key = CONFIG.keys === null ? {name: null, models: ['*']} : lookUp(r);
    if (key === undefined) {
        unauthorized(r);
        return;
    }
    if (entry !== null && r.method === 'POST' && body !== undefined && body.length > 0) {
        read = readBody(r, body);
        if (read === null) {
            return;
        }
        doc = read.doc;
        top = read.top;
        stream = read.stream;
        // the model, as the router checks it, but for none named: vLLM takes a request that
        // names none as its first served name's (vllm 0.32 entrypoints/serve/engine/serving.py
        // _is_model_supported), so the serve's own port lets it through
        var model = read.model;
        if (model !== undefined && model !== null && model !== '') {
            if (typeof model !== 'string') {
                fail(r, 400, '"model" must be a string', 'invalid_model', 'model');
                return;
            }
            if (!has(CONFIG.models, model) || CONFIG.models[model].serve !== serve ||
                    !allows(key, model)) {
                notFound(r, model, key);
                return;
            }
            r.variables.router_model = model;
        }
        r.variables.router_serve = serve;
        r.variables.router_key = key.name || '';
        r.variables.router_requester = requesterOf(r, key);
        askUsage(r, body, doc, top, entry, stream);
        if (entry.priority && !read.form && PRIORITY_ROUTES.indexOf(r.uri) >= 0 &&
            !keyPriority(r, body, doc, top, key)) {
            return;
        }
        // a stream for a serve gpud may bring up: the router's loading feedback, where the
        // port asks gpud's ensure itself (its server has the router's locations of it:
        // gpud.core.routerconf front_policy, $gpud_loading)
        if (entry.ensure && CONFIG.loading_feedback_s > 0 && stream &&
                r.variables.gpud_loading === '1') {
            r.internalRedirect('@router_loading');
            return;
        }
    }
    r.internalRedirect(FRONT_SEND);
}

// The table's entry of SERVE (one of its names'), null when the router has none.
function serveEntry(serve) {
    var entry = null;
    Object.keys(CONFIG.models).forEach(function (name) {
        if (CONFIG.models[name].serve === serve) {
            entry = CONFIG.models[name];
        }
    });
    return entry;
}

// A stream for a serve gpud may bring up, past its key's limits (@router_loading): through
// the router, or on the serve's fronted port (router.fronted), where a request may name no
// model (its comments then say the serve's name, and gpud is told none, as by the port's
// own ensure).
function loadingStream(r) {
    var model = r.variables.router_model || '', serve = r.variables.router_serve;
    if (has(CONFIG.models, model)) {
        loading(r, model, CONFIG.models[model]);
    } else {
        loading(r, serve, serveEntry(serve));
    }
}

// A key past a token budget (gpud.core.quota, CONFIG.over_budget: gpud's decision as it stores
// usage): the whole seconds to the period's end (js_set $router_quota, Retry-After), "" when the
// request's key is past none, or the period it was past has ended (the time alone decides:
// the key is let in again then, before gpud looks again).
function overOf(r) {
    var name = r.variables.router_key_name || '';
    var over = name && has(CONFIG.over_budget, name) ? CONFIG.over_budget[name] : null;
    var left = over ? over.until - Math.floor(Date.now() / 1000) : 0;
    return left > 0 ? {name: name, over: over, left: left} : null;
}

function quota(r) {
    var o = overOf(r);
    return o ? String(o.left) : '';
}

// Its 429's document (@router_quota's `return`: no body read), in OpenAI's shape for a quota
// used up: type and code insufficient_quota.
function quotaText(r) {
    var o = overOf(r);
    if (!o) {
        return '';
    }
    var p = o.over.period;
    return JSON.stringify({error: {
        message: 'key ' + o.name + ' has used its tokens_per_' + p + ' of ' + o.over.limit +
                 ' tokens (prompt + completion) this ' + p + ' (UTC); retry after ' + o.left +
                 ' s, when the ' + p + ' ends',
        type: 'insufficient_quota', param: null, code: 'insufficient_quota',
        gpud: {key: o.name, limit: 'tokens_per_' + p, value: o.over.limit, until: o.over.until,
               retry_after_s: o.left}}});
}

// Past a key's requests_per_minute (nginx's limit_req where the router sent the request: the
// serve's location, or @router_loading): 429 in OpenAI's shape (code rate_limit_exceeded),
// the limit and its figure, and Retry-After: a minute's share of it. (Past a count of requests
// open at once, max_concurrent or large bodies, the 429 is countedText's.)
function limited(r) {
    var name = r.variables.router_key_name || '';
    var lim = has(CONFIG.limits, name) ? CONFIG.limits[name] : {};
    var value = lim.requests_per_minute;
    var answer = rateLimited('key ' + name + ' is past its limit of ' + value +
                             ' requests per minute', Math.max(1, Math.ceil(60 / (value || 60))),
                             {key: name, limit: 'requests_per_minute', value: value});
    r.headersOut['Retry-After'] = answer.retry;
    r.headersOut['Content-Type'] = 'application/json';
    r.return(answer.status, JSON.stringify(answer.doc));
}

export default {route, fronted, keyName, countedText, unauthorizedText, keyOk, quota, quotaText, requesterOf, models, model,
                refused, down, streamed, streamDown, peerDown, peerStreamed,
                errorPage,
                loadingStream, limited, meter, ensured};
