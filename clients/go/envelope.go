package messaging

// Envelopes: which event a payload carries (raw, CloudEvents binary or structured, MassTransit),
// where its data is, and which transport headers contradict it (docs/semantics.md C11). Pure:
// it must not count (NewDelivery does) nor talk to a broker.

import (
	"bytes"
	"encoding/json"
	"strings"
)

// Format is how a message carries its event.
type Format string

const (
	Raw                   Format = "Raw"
	CloudEventsBinary     Format = "CloudEventsBinary"
	CloudEventsStructured Format = "CloudEventsStructured"
	MassTransit           Format = "MassTransit"
)

// Header is one transport header as it arrived.
type Header struct{ Name, Value string }

// Event is the event's identity as its envelope states it.
type Event struct {
	Format        Format
	ID            string
	Source        string
	Type          string
	CorrelationID string
	ContentType   string
}

// Foreign holds the transport headers that contradicted the envelope (empty for CloudEvents
// and raw payloads). The event is still the envelope's.
type Foreign struct{ Headers []Header }

// Get is one contradicting header, by case-insensitive name.
func (f Foreign) Get(name string) (string, bool) { return header(f.Headers, name) }

// Empty reports whether nothing contradicted the envelope.
func (f Foreign) Empty() bool { return len(f.Headers) == 0 }

var (
	correlationHeaders = []string{"correlation-id", "correlation_id", "correlationid"}
	messageIDHeaders   = []string{"message-id", "message_id", "messageid"}
)

func header(hs []Header, name string) (string, bool) {
	for _, h := range hs {
		if strings.EqualFold(h.Name, name) {
			return h.Value, true
		}
	}
	return "", false
}

type parsed struct {
	event   Event
	foreign Foreign
	data    []byte // JSON (or raw bytes) Decode reads
}

func startsObject(payload []byte) bool {
	for _, b := range payload {
		switch b {
		case ' ', '\t', '\r', '\n', '\f', '\v':
		default:
			return b == '{'
		}
	}
	return false
}

// keysNamed says whether a JSON object payload names "specversion" or "messageType" anywhere
// (the envelope of an untyped payload is recognised by them).
func keysNamed(payload []byte) (specversion, messageType bool) {
	if !startsObject(payload) {
		return false, false
	}
	return bytes.Contains(payload, []byte(`"specversion"`)), bytes.Contains(payload, []byte(`"messageType"`))
}

// parseEnvelope reads the envelope.
func parseEnvelope(headers []Header, payload []byte) *parsed {
	specversion, messageType := keysNamed(payload)
	if len(headers) == 0 && !specversion && !messageType {
		return &parsed{event: Event{Format: Raw}, data: payload}
	}
	contentType, _ := header(headers, "content-type")
	ct := strings.ToLower(contentType)
	if p, ok := cloudEventsBinary(headers, contentType, payload); ok {
		return &p
	}
	if p, ok := cloudEventsStructured(ct, contentType, payload, specversion); ok {
		return &p
	}
	if p, ok := massTransit(headers, ct, contentType, payload, messageType); ok {
		return &p
	}
	return &parsed{event: Event{Format: Raw, ContentType: contentType}, data: payload}
}

func cloudEventsBinary(headers []Header, contentType string, payload []byte) (parsed, bool) {
	ce := func(attr string) string {
		if v, ok := header(headers, "ce-"+attr); ok {
			return v
		}
		v, _ := header(headers, "ce_"+attr)
		return v
	}
	_, dash := header(headers, "ce-specversion")
	_, under := header(headers, "ce_specversion")
	if !dash && !under {
		return parsed{}, false
	}
	return parsed{
		event: Event{Format: CloudEventsBinary, ID: ce("id"), Source: ce("source"), Type: ce("type"),
			CorrelationID: ce("correlationid"), ContentType: contentType},
		data: payload,
	}, true
}

// strField reads a field as the Rust runtime does: strings as they are, other values as JSON.
func strField(doc map[string]json.RawMessage, key string) string {
	raw, ok := doc[key]
	if !ok || string(raw) == "null" {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var v any
	if json.Unmarshal(raw, &v) != nil {
		return ""
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func object(payload []byte) (map[string]json.RawMessage, bool) {
	var doc map[string]json.RawMessage
	if json.Unmarshal(payload, &doc) != nil || doc == nil {
		return nil, false
	}
	return doc, true
}

func cloudEventsStructured(ct, contentType string, payload []byte, named bool) (parsed, bool) {
	if !(strings.HasPrefix(ct, "application/cloudevents+json") || (ct == "" && named)) {
		return parsed{}, false
	}
	doc, ok := object(payload)
	if !ok {
		return parsed{}, false
	}
	data := []byte(doc["data"])
	if data == nil {
		data = []byte{}
	}
	dct := strField(doc, "datacontenttype")
	if dct == "" {
		dct = contentType
	}
	return parsed{
		event: Event{Format: CloudEventsStructured, ID: strField(doc, "id"), Source: strField(doc, "source"),
			Type: strField(doc, "type"), CorrelationID: strField(doc, "correlationid"), ContentType: dct},
		data: data,
	}, true
}

func massTransit(headers []Header, ct, contentType string, payload []byte, named bool) (parsed, bool) {
	if !(strings.HasPrefix(ct, "application/vnd.masstransit+json") || (ct == "" && named)) {
		return parsed{}, false
	}
	doc, ok := object(payload)
	if !ok {
		return parsed{}, false
	}
	var types []json.RawMessage
	_ = json.Unmarshal(doc["messageType"], &types)
	eventType := ""
	if len(types) > 0 {
		_ = json.Unmarshal(types[0], &eventType)
	}
	ev := Event{Format: MassTransit, ID: strField(doc, "messageId"), Source: strField(doc, "sourceAddress"),
		Type: eventType, CorrelationID: strField(doc, "correlationId"), ContentType: contentType}
	data := []byte(doc["message"])
	if data == nil {
		data = []byte("null")
	}
	return parsed{event: ev, foreign: contradicting(headers, ev), data: data}, true
}

func contradicting(headers []Header, ev Event) Foreign {
	var f Foreign
	for _, rule := range []struct {
		names []string
		value string
	}{{correlationHeaders, ev.CorrelationID}, {messageIDHeaders, ev.ID}} {
		if rule.value == "" {
			continue
		}
		for _, h := range headers {
			for _, n := range rule.names {
				if strings.EqualFold(h.Name, n) && h.Value != rule.value {
					f.Headers = append(f.Headers, h)
					break
				}
			}
		}
	}
	return f
}
