/**
 * A tiny element builder. Text from the server (names, reasons, messages) only
 * ever becomes textContent, never HTML.
 */
export type Child = Node | string | null | undefined | false;

export function h(
  tag: string,
  attrs: Record<string, string | undefined> = {},
  ...children: Child[]
): HTMLElement {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== undefined) {
      el.setAttribute(name, value);
    }
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) {
      continue;
    }
    el.appendChild(
      typeof child === 'string' ? document.createTextNode(child) : child
    );
  }
  return el;
}

/** Replace all children of `el`. */
export function replaceChildren(el: HTMLElement, ...children: Child[]): void {
  while (el.firstChild) {
    el.removeChild(el.firstChild);
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) {
      continue;
    }
    el.appendChild(
      typeof child === 'string' ? document.createTextNode(child) : child
    );
  }
}
